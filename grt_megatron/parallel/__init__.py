"""Parallel layouts applied from outside the model: checks of a layout before any process group starts,
and the gradient handling sequence parallelism needs under DeepSpeed.

Tensor parallelism lives in the layers themselves (megatron-core column/row-parallel linears, the
vocab-parallel embedding and loss); data parallelism and ZeRO in DeepSpeed. What is left is here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from grt_megatron.model.config import ConfigError


def split_global_batch(global_batch: int, micro_batch: Optional[int], dp: int, layout: str = "") -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) that make up `global_batch` on `dp` data-parallel
    ranks; `micro_batch` None: each rank's whole share at once. A split that does not work is refused,
    naming the micro-batch sizes that would (`layout` says where `dp` came from)."""
    where = f"data-parallel size {dp}{layout}"
    if global_batch % dp:
        raise ConfigError(f"train.global_batch_size={global_batch} cannot be shared by {where}: it must be a "
                          f"multiple of {dp}")
    per_rank = global_batch // dp
    micro = per_rank if micro_batch is None else micro_batch
    if per_rank % micro:
        fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ConfigError(f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size "
                          f"({micro}) × {where}; micro-batch sizes that work: {', '.join(map(str, fits))}")
    return micro, per_rank // micro


def validate_layout(*, world_size: int, tp: int, pp: int, sp: bool, zero_stage: int, model: dict,
                    seq_length: int, micro_batch: Optional[int], global_batch: int) -> int:
    """Refuse layouts that cannot work, with the reason, before anything is launched. Returns the
    data-parallel size."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel.tp={tp} and parallel.pp={pp} must be >= 1")
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} processes cannot be split into parallel.tp={tp} × parallel.pp={pp} "
                          "groups (the world size must be a multiple of tp × pp)")
    dp = world_size // (tp * pp)
    heads, hidden = model.get("num_attention_heads", 1), model.get("hidden_size", 1)
    ffn = model.get("ffn_hidden_size") or 4 * hidden
    for name, value in (("num_attention_heads", heads), ("hidden_size", hidden), ("ffn_hidden_size", ffn)):
        if value % tp:
            raise ConfigError(f"model.{name}={value} is not divisible by parallel.tp={tp}")
    if sp and tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1 (it shards activations over the TP group)")
    if sp and seq_length % tp:
        raise ConfigError(f"train.seq_length={seq_length} is not divisible by parallel.tp={tp} "
                          "(sequence parallelism shards the sequence)")
    if pp > 1 and zero_stage >= 2:
        raise ConfigError(f"deepspeed.zero_stage={zero_stage} cannot be combined with parallel.pp={pp}: "
                          "DeepSpeed's pipeline engine supports ZeRO 0 and 1 only")
    if zero_stage == 3 and (tp > 1 or pp > 1):
        raise ConfigError("deepspeed.zero_stage=3 needs parallel.tp=1 and parallel.pp=1 "
                          "(ZeRO 3 partitions parameters itself); use ZeRO 1 or 2 with tensor parallelism")
    if pp > 1 and model.get("routing", "none") != "none":
        raise ConfigError(f"model.routing={model['routing']!r} (MoR) is not supported with parallel.pp={pp}: its "
                          "auxiliary router loss and per-sequence top-k are not split into pipeline stages; "
                          "use data parallelism")
    if pp > 1:
        p, k, c = (int(model.get(f"{name}_layers", 1)) for name in ("prelude", "core", "coda"))
        dense = model.get("recurrences", 1) == 1 and model.get("gate") == "none" and model.get("injection") == "none"
        units = 3 + p + c + (k if dense else 1)  # embedding, final norm, head; the core is one unit
        if pp > units:
            raise ConfigError(f"parallel.pp={pp} stages but the model has only {units} pipeline units "
                              "(embedding, prelude layers, the core, coda layers, final norm, head)")
    if pp > 1 and zero_stage == 0:
        raise ConfigError(f"parallel.pp={pp} needs deepspeed.zero_stage=1: with ZeRO 0, DeepSpeed's pipeline "
                          "engine clips with a wrong gradient norm (tied and TP-replicated gradients "
                          "miscounted) and reports none")
    split_global_batch(global_batch, micro_batch, dp, f" ({world_size} processes / tp {tp} / pp {pp})")
    return dp


def register_sequence_parallel_grad_hooks(model: torch.nn.Module) -> int:
    """Sum, over the tensor-parallel group, the gradients of parameters that each TP rank applies to its
    own slice of the sequence (norms, biases added after a reduce-scatter: megatron marks them with
    `sequence_parallel`). megatron-core does this in its own DDP; under DeepSpeed nothing does, and
    nothing fails without it — the loss is just silently wrong. The hook acts on each gradient before
    it is accumulated, so DeepSpeed's ZeRO hooks (which run after accumulation) see the full sum."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    count = 0
    for param in model.parameters():
        if param.requires_grad and getattr(param, "sequence_parallel", False):
            param.register_hook(all_reduce)
            count += 1
    return count
