"""ModuleSpecs for the GRT block: megatron-core's local (pure PyTorch) layer spec plus parallel linears.

The local spec runs on CPU and GPU alike; a Transformer-Engine spec can be swapped in here without
touching the model math.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.recurrent_block import GatedRecurrentBlock, GatedRecurrentBlockSubmodules


class TorchNorm:
    """torch's LayerNorm / RMSNorm from a megatron config, like megatron's `WrappedTorchNorm` but usable
    with sequence parallelism: there each TP rank normalises its own slice of the sequence, so the
    parameters are marked `sequence_parallel` and their gradients summed over the TP group
    (`grt_megatron.parallel.register_sequence_parallel_grad_hooks`)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"model.normalization={config.normalization!r} is not one of LayerNorm, RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def get_norm_spec() -> type:
    return TorchNorm


def get_layer_spec(config: GRTConfig) -> ModuleSpec:
    """megatron-core's local GPT layer with our norms (the local spec's torch norm refuses SP)."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.input_layernorm = get_norm_spec()
    spec.submodules.pre_mlp_layernorm = get_norm_spec()
    return spec


def get_grt_block_spec(config: GRTConfig) -> ModuleSpec:
    return ModuleSpec(
        module=GatedRecurrentBlock,
        submodules=GatedRecurrentBlockSubmodules(
            layer=get_layer_spec(config),
            injection=RowParallelLinear,
            gate_norm=get_norm_spec(),
            gate_fc1=ColumnParallelLinear,
            gate_fc2=RowParallelLinear,
        ),
    )
