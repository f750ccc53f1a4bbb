"""ModuleSpecs for the GRT block: megatron-core's local (pure PyTorch) layer spec plus parallel linears.

The local spec runs on CPU and GPU alike; a Transformer-Engine spec can be swapped in here without
touching the model math.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.recurrent_block import GatedRecurrentBlock, GatedRecurrentBlockSubmodules


def get_norm_spec() -> type:
    return WrappedTorchNorm


def get_grt_block_spec(config: GRTConfig) -> ModuleSpec:
    return ModuleSpec(
        module=GatedRecurrentBlock,
        submodules=GatedRecurrentBlockSubmodules(
            layer=get_gpt_layer_local_spec(normalization=config.normalization),
            injection=RowParallelLinear,
            gate_norm=get_norm_spec(),
            gate_fc1=ColumnParallelLinear,
            gate_fc2=RowParallelLinear,
        ),
    )
