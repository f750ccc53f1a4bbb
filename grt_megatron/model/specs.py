"""ModuleSpecs for the GRT block: megatron-core's local (pure PyTorch) layer spec, with torch's fused
attention kernel as its core attention, plus parallel linears.

The local spec runs on CPU and GPU alike. `model.layer_spec=transformer_engine` (what `auto` picks where
Transformer Engine is importable with CUDA, model/kernels.py) swaps in TE's linears, norms and fused
attention module for module, so every parameter keeps its local name: checkpoints, resharding and the HF
export need no mapping. (TE's fused norm+linear would rename the norms into the linears; not used.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from grt_megatron.device import autocast_dtype
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


class SDPACoreAttention(MegatronModule):
    """megatron-core's core-attention contract (q, k, v [s, b, heads, head_dim] -> [s, b, heads·head_dim])
    through torch's `scaled_dot_product_attention`: one fused kernel (flash / memory-efficient on GPU, a
    fused CPU kernel) instead of the local spec's baddbmm + masked softmax + dropout + bmm, which cost
    grt-megatron 13% of a tiny model's CPU step against plain PyTorch (`tools/bench/overhead.py`).
    Without a mask attention is causal through the kernel's own `is_causal`; a mask (packed documents,
    `layers.document_attention_mask`, True where forbidden) goes to the kernel as its complement."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as megatron's default

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention supports neither attention_bias nor packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head_dim]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        p = self.dropout if self.training else 0.0

        allowed = None if attention_mask is None else ~attention_mask

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p,
                                                  is_causal=allowed is None, scale=self.softmax_scale)

        if p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # dropout differs across TP ranks' heads
                out = attend()
        else:
            out = attend()
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class _TorchAutogradWhenLocal:
    """megatron-core's parallel linears, whose matrix product runs through torch's own autograd whenever
    megatron's autograd Function would only multiply: no all-reduce of the input gradient in backward
    (one tensor-parallel rank, or a row-parallel linear), no sequence parallelism, no fused weight-gradient
    accumulation, no deferred weight gradients. Megatron's Function then computes
    `input @ weight.t() (+ bias)` and the same two products in backward, to the bit
    (tests/test_kernels.py), but in Python: about 0.1 ms a call in eager mode, 70–80 calls in a small GRT's
    step on a CPU and the host time a GPU step waits for. While torch.compile traces, the tensor-parallel
    cases go there too (`_linear`); everything else goes to megatron's Function."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        allreduce_dgrad, sequence_parallel = kwargs.get("allreduce_dgrad"), kwargs.get("sequence_parallel")
        # What `_linear` has: no fused weight-gradient accumulation, no deferred weight gradients.
        plain = (not args and not kwargs.get("gradient_accumulation_fusion") and kwargs.get("grad_output_buffer") is None
                 and not (allreduce_dgrad and sequence_parallel))
        communicates = allreduce_dgrad or sequence_parallel
        if plain and (torch.compiler.is_compiling() or (not communicates and weight.requires_grad)):
            return _linear(input, weight, **kwargs)
        dtype = autocast_dtype(input.device.type)
        if dtype is not None and input.is_floating_point():
            # Under autocast (`bf16-mixed`) megatron's Function gets the input autocast would multiply: with
            # SP it allocates the reduce-scatter's output in the input's dtype (fp32 after a norm) for a bf16
            # gradient, which gloo and NCCL refuse, so TP 2 + SP crashed in the first backward. The same
            # numbers (the product casts it anyway), and the all-gather and the saved input in half the bytes.
            input = input.to(dtype)
        return super()._forward_impl(input, weight, *args, **kwargs)


def _linear(input, weight, bias=None, allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **_unused):
    """megatron's linear Function's numbers through torch's autograd: the product alone where the Function
    would only multiply, and while torch.compile traces, its tensor-parallel collectives too (`train.compile`
    with TP or SP).

    Compiled: megatron's Function overlaps the backward's all-reduce (TP) or all-gather and reduce-scatter
    (SP) with the weight gradient through `async_op=True` collectives, which dynamo cannot trace: every TP
    linear broke its layer's graph, and at a break inside the recurrence step's loop over the core layers
    dynamo gave the loop up to eager mode (20 graph pieces in a tiny GRT's 2 steps at TP 2 + SP, 4 graphs in
    one process). Here the same collectives run through megatron's synchronous region functions, which
    dynamo traces as torch's functional collectives (`parallel/traceable_tp.py`): all-gather the sequence
    shards (backward: reduce-scatter the input gradient), or pass the input on (backward: all-reduce its
    gradient), then the local product. Eager mode keeps megatron's Function and its overlap; compiled,
    inductor schedules the collectives."""
    if sequence_parallel:
        input = tensor_parallel.gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                                     group=tp_group)
    elif allreduce_dgrad:
        input = tensor_parallel.copy_to_tensor_model_parallel_region(input, group=tp_group)
    # F.linear, not matmul(input, weight.t()): the same product (ATen's linear is that matmul without a
    # bias), but autocast (`train.precision=bf16-mixed`) caches its cast of `weight`, a leaf, for the
    # whole forward, where the transposed view would be cast again at every use: the shared core's
    # weights would be cast R times forward and their gradients R times backward.
    output = F.linear(input, weight)
    return output if bias is None else output + bias


class ColumnLinear(_TorchAutogradWhenLocal, ColumnParallelLinear):
    """`ColumnParallelLinear` (same parameters, same initialisation) with `_TorchAutogradWhenLocal`."""


class RowLinear(_TorchAutogradWhenLocal, RowParallelLinear):
    """`RowParallelLinear` (same parameters, same initialisation) with `_TorchAutogradWhenLocal`."""


def get_norm_spec() -> type:
    return TorchNorm


def get_bias_dropout_add_in_residual_dtype(training: bool, fused: bool):
    """megatron-core's bias-dropout-add, `residual + dropout(x + bias)`, in the residual's dtype
    (`model.fp32_residual_connection`): megatron's casts the residual to the sublayer output's dtype (for
    pipeline sends of one dtype), so under autocast an fp32 stream became bf16 at the first layer, its
    flag notwithstanding. Unfused (`fused` is ignored): `train.compile` fuses it with its neighbours."""

    def bias_dropout_add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        x = x if bias is None else x + bias
        return residual + F.dropout(x, p=prob, training=training).to(residual.dtype)

    return bias_dropout_add


def get_layer_spec(config: GRTConfig) -> ModuleSpec:
    """megatron-core's local GPT layer with our norms (the local spec's torch norm refuses SP), or the same
    layer built from Transformer Engine's modules; with `fp32_residual_connection`, a bias-dropout-add that
    keeps the stream fp32."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if config.fp32_residual_connection:
        spec.submodules.self_attn_bda = spec.submodules.mlp_bda = get_bias_dropout_add_in_residual_dtype
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    if config.layer_spec == "transformer_engine":
        from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear, TEDotProductAttention,
                                                                 TENorm, TERowParallelLinear)
        attention.linear_qkv, attention.linear_proj = TEColumnParallelLinear, TERowParallelLinear
        attention.core_attention = TEDotProductAttention
        mlp.linear_fc1, mlp.linear_fc2 = TEColumnParallelLinear, TERowParallelLinear
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TENorm
        return spec
    attention.core_attention = SDPACoreAttention
    attention.linear_qkv, attention.linear_proj = ColumnLinear, RowLinear
    mlp.linear_fc1, mlp.linear_fc2 = ColumnLinear, RowLinear
    spec.submodules.input_layernorm = get_norm_spec()
    spec.submodules.pre_mlp_layernorm = get_norm_spec()
    return spec


def get_grt_block_spec(config: GRTConfig) -> ModuleSpec:
    return ModuleSpec(
        module=GatedRecurrentBlock,
        submodules=GatedRecurrentBlockSubmodules(
            layer=get_layer_spec(config),
            injection=RowLinear,
            gate_norm=get_norm_spec(),
            gate_fc1=ColumnLinear,
            gate_fc2=RowLinear,
        ),
    )
