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

    attention_mask: Optional[torch.Tensor]
    """None: causal attention (the attention kernel's own mask). Else [b, 1, s, s] booleans, True where
    attention is forbidden (megatron's convention): `document_attention_mask`, packed documents."""
    rotary_pos_emb: Optional[torch.Tensor] = None
    noise_seeds: Optional[Sequence[int]] = None


def later_positions(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] booleans, True where the key comes after the query: what causal attention forbids."""
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document index of every position -> [b, 1, s, s] mask, True where attention is forbidden:
    a token attends causally within its own document only (Megatron-LM's `--reset-attention-mask`)."""
    later = later_positions(document_ids.shape[1], document_ids.device)
    return (later | (document_ids[:, :, None] != document_ids[:, None, :])).unsqueeze(1)


def document_ids_of(tokens: torch.Tensor, eos_id: Optional[int]) -> Optional[torch.Tensor]:
    """[b, s] tokens -> [b, s] document index: the number of EOS tokens strictly before each position, so
    an EOS closes its document (as Megatron-LM resets attention after each end-of-document token).
    `eos_id` None (no `data.reset_attention_mask`): None, plain causal attention."""
    if eos_id is None:
        return None
    eos = (tokens == eos_id).to(torch.int32)
    return eos.cumsum(dim=1) - eos


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
