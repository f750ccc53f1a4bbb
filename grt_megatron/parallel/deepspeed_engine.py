"""The data-parallel engine: DeepSpeed (ZeRO stage, precision, clipping) around the model, with the
optimizer and LR schedule it steps."""

from __future__ import annotations

import math
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import get_norm_dtype
from megatron.core import parallel_state

from grt_megatron.device import device_zeros
from grt_megatron.parallel.layout import split_global_batch
from grt_megatron.training.config import RunConfig


class MegatronMPU:
    """What DeepSpeed asks of an `mpu`, answered from megatron-core's parallel state.

    DeepSpeed calls the tensor-parallel group the "model parallel" group (for grad-norm de-duplication
    and ZeRO partitioning); megatron-core names it `tensor_model_parallel`.
    """

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norms and biases (1-D) are not decayed, as in Megatron-LM."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_lambda(train_cfg, base_lr: float):
    """Linear warmup to `lr`, cosine decay to `min_lr` at `decay_iters`, then constant."""
    warmup = train_cfg.warmup_iters
    decay_iters = train_cfg.decay_iters or train_cfg.iters
    floor = train_cfg.min_lr / base_lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= decay_iters:
            return floor
        progress = (step - warmup) / max(1, decay_iters - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def batch_layout(cfg: RunConfig, dp_size: int) -> tuple[int, int]:
    """(micro batch size, gradient accumulation steps) for this data-parallel size."""
    return split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp_size)


def engine_zero_stage(cfg: RunConfig) -> int:
    """The ZeRO stage DeepSpeed is built with. bf16 with fp32 gradient accumulation exists in DeepSpeed
    only as its BF16 optimizer, which it selects at stage 1 (at stage 0 it refuses the combination); with
    one data-parallel rank stage 1 partitions nothing, with more it shards the fp32 master weights and
    Adam moments, which changes no number."""
    stage = cfg.deepspeed.zero_stage
    if stage == 0 and cfg.train.precision == "bf16" and cfg.deepspeed.grad_accum_dtype == "fp32":
        return 1
    return stage


def clips_outside_deepspeed(cfg: RunConfig) -> bool:
    """Whether the trainer clips (and measures) the gradient norm itself: with fp32 weights (fp32,
    bf16-mixed) and no ZeRO, DeepSpeed hands the bare optimizer the gradients and does not report the norm
    it computes; every other layout clips inside DeepSpeed's optimizer wrapper. (Pipelines need ZeRO >= 1,
    checked with the layout.)"""
    return cfg.deepspeed.zero_stage == 0 and cfg.train.precision in ("fp32", "bf16-mixed")


def deepspeed_config(cfg: RunConfig, dp_size: int, clip_in_deepspeed: bool = True) -> dict[str, Any]:
    t = cfg.train
    micro, accumulation = batch_layout(cfg, dp_size)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed reads 0 as "no clipping", as train.grad_clip does (0 or null).
        "gradient_clipping": (t.grad_clip or 0.0) if clip_in_deepspeed else 0.0,
        "zero_optimization": {"stage": engine_zero_stage(cfg)},
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.pp > 1 and cfg.parallel.sp:
        # DeepSpeed's pipeline sends each TP rank 1/TP of the activation (and of its gradient) and gathers the
        # pieces over the TP group on arrival, which assumes the TP ranks hold the same tensor. Under SP each
        # holds its own part of the sequence: the gathered tensor mixed the ranks' parts, and PP 2 x TP 2 + SP
        # trained on wrong activations from the first step (loss 7.6264 where one process has 7.6199). Each
        # rank sends its own part whole instead.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if t.precision == "bf16":
        # Gradients of bf16 layers are summed over micro-batches and over data-parallel ranks in fp32:
        # bf16's 8-bit mantissa would round small contributions away at every addition.
        ds["data_types"] = {"grad_accum_dtype": cfg.deepspeed.grad_accum_dtype}
        ds["communication_data_type"] = cfg.deepspeed.communication_data_type
    if t.optimizer == "deepspeed":
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.adam_eps,
                       "weight_decay": t.weight_decay, "torch_adam": t.torch_adam},
        }
    return ds


def build_engine(model: torch.nn.Module, cfg: RunConfig, dp_size: int, clip_in_deepspeed: bool = True):
    """Wrap the model with `deepspeed.initialize` (ZeRO stage, precision, clipping from the run config)."""
    t = cfg.train
    groups = param_groups(model, t.weight_decay)
    optimizer = None
    if t.optimizer == "torch":
        # fused=None is torch's default implementation (foreach on CUDA, a loop on CPU).
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                                      fused=True if t.fused_adam else None)
    # A PipelineModule brings its own process grid (from its topology); DeepSpeed refuses an mpu then.
    pipelined = isinstance(model, deepspeed.pipe.PipelineModule)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=groups,
        config=deepspeed_config(cfg, dp_size, clip_in_deepspeed),
        # DeepSpeed builds the schedule on its inner (unwrapped) optimizer and steps it once per
        # optimizer step, and saves it with its checkpoints.
        lr_scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(t, t.lr)),
        mpu=None if pipelined else MegatronMPU(),
        dist_init_required=False,
    )
    if dp_size == 1 and not pipelined and gradient_reduction_is_only_communication(engine):
        # One data-parallel rank: DeepSpeed's all-reduce would flatten every gradient into one buffer,
        # multiply it by 1/1, reduce it over a group of one and copy it back (2.4 ms a step at the small
        # CPU shape, a full copy of the gradients on a GPU) and change no bit.
        engine.enable_backward_allreduce = False
    if pipelined:
        keep_pipe_buffers_per_dtype(engine)
        if isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
            reduce_grad_norm_once(engine.optimizer)
    return engine


def keep_pipe_buffers_per_dtype(engine) -> None:
    """Give each dtype its own pipeline receive buffers.

    DeepSpeed's pipeline engine takes the buffers it receives activations (from the previous stage) and
    gradients (from the next) into from one pool, by position only: a request for a bf16 buffer where an
    fp32 one of enough elements exists gets a view of the fp32 one. A stage whose input and output differ
    in dtype then receives its output's gradient into a buffer of its input's dtype, and trains on garbage.
    Under `bf16-mixed` that is the stage after the embedding alone (fp32 in, bf16 out of a layer): the tiny
    GRT at PP 4 (then split by layer count) reported grad norm 51.7 where one process has 1.57 (gloo; NCCL
    would be handed mismatched sizes). Same dtype, same sharing as DeepSpeed's; another dtype, another buffer.
    """

    def allocate_or_extend_buffers(idx, shape, dtype):
        pool = engine._grad_layer_buf  # DeepSpeed resets it to [] when the activation shape is reset
        while len(pool) <= idx:
            pool.append({})
        numel = math.prod(shape)
        buffer = pool[idx].get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = pool[idx][dtype] = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
            return buffer
        return buffer.flatten()[:numel].view(shape)

    engine._allocate_or_extend_buffers = allocate_or_extend_buffers


def reduce_grad_norm_once(optimizer: DeepSpeedZeroOptimizer) -> None:
    """Make ZeRO 1's gradient norm one reduction over the model-parallel group, not one per parameter group.

    DeepSpeed's ZeRO 1/2 optimizer reduces each parameter group's norm over the model-parallel group, which
    in a pipeline spans the stages. Parameter groups are per stage (decayed matrices, undecayed norms and
    biases; DeepSpeed drops an empty one), so a stage that holds only one kind makes fewer reductions than
    the others and every rank waits forever in the first optimizer step (DeepSpeed issue #1522, open since
    2021). That is the embedding alone on the first stage: the shared baseline at PP 2, the tiny GRT at
    PP 4 and the medium GRT at PP 5 when stages were balanced by layer count; now where
    `parallel.pp_split_points` puts it, or with as many stages as units. Here each rank sums the squared
    norms of all its groups first, as Megatron-LM does: the same terms, counted by DeepSpeed's rules
    (pipeline-replicated copies once, TP-replicated ones on TP rank 0), one reduction over the
    data-parallel group and one over the model-parallel group. A non-finite norm is reported as inf, as
    DeepSpeed's combined group norms are.
    """
    assert not optimizer.cpu_offload and not optimizer.has_moe_layers, "not configured by grt-megatron"

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only the L2 norm"
        squares = []
        for i, params in enumerate(optimizer.params_in_partition):
            grads = (g for g in optimizer.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
            for g, p in zip(grads, params):
                if getattr(p, PIPE_REPLICATED, False):
                    continue
                if is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0:
                    squares.append(torch.linalg.vector_norm(g.detach().to(get_norm_dtype())).square())
        total = torch.stack(squares).sum() if squares else device_zeros(dtype=get_norm_dtype())
        total = total.to(optimizer.device)
        deepspeed.comm.all_reduce(total, group=optimizer.dp_process_group)
        deepspeed.comm.all_reduce(total, group=optimizer.model_parallel_group)
        norm = total.sqrt().float()
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, math.inf))

    optimizer.scaled_global_norm = scaled_global_norm


def gradient_reduction_is_only_communication(engine) -> bool:
    """Whether DeepSpeed's backward gradient reduction only communicates (and so may be skipped with one
    data-parallel rank): without ZeRO, and in the BF16 optimizer (whose fp32 accumulation runs before it,
    in its backward epilogue). ZeRO's optimizers partition and copy gradients in that same call."""
    return engine.zero_optimization_stage() == 0 or isinstance(engine.optimizer, BF16_Optimizer)

