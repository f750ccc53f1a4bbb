"""What every layer execution of the block shares: the inputs of one forward pass, running a stack of
megatron-core `TransformerLayer`s over them, and building that stack (or part of it, for a pipeline unit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from grt_megatron.model.init import piece_rng


@dataclass
class StepInputs:
    """What every layer execution of one forward pass shares."""

    attention_mask: torch.Tensor
    rotary_pos_emb: Optional[torch.Tensor] = None
    noise_seeds: Optional[Sequence[int]] = None


def run_layers(layers, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    for layer in layers:
        hidden, _ = layer(hidden, attention_mask=inputs.attention_mask, rotary_pos_emb=inputs.rotary_pos_emb)
    return hidden


def build_layer_stack(spec: ModuleSpec, config, init_seed: int, owned: set[int]) -> torch.nn.ModuleList:
    """Layers 0 … num_layers−1, each drawn from its own seed. Layers not in `owned` (a pipeline unit's
    block builds a part) are `Identity` placeholders, so every layer keeps its global index and name."""

    def layer(i: int):
        # Layer numbers are 1-based and unique, as megatron-core expects.
        with piece_rng(init_seed, f"layer.{i}"):
            return build_module(spec, config=config, layer_number=i + 1)

    return torch.nn.ModuleList(layer(i) if i in owned else torch.nn.Identity() for i in range(config.num_layers))
