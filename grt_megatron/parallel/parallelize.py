"""`parallelize`: the one place a layout is applied to the model.

torchtitan's shape: the model (`GRTLanguageModel`) is defined once with no parallelism of its own; this
function takes a run's layout and returns what the training loop drives:
1. the layout checked (`validate_layout`, the same call grt-train's config check and grt-submit make);
2. tensor / sequence parallelism: megatron-core's layers split themselves by the model config's
   `tensor_model_parallel_size` and `sequence_parallel`; the gradient reduction SP needs under DeepSpeed
   is added here (`sequence_parallel.py`);
3. pipeline parallelism: this rank's stage, its units cut from the one model (`pipeline.py`);
4. `train.precision=bf16-mixed`: the forward under autocast (`mixed_precision.py`);
5. `train.compile`: the recurrence step and the other layers compiled in place (`compile.py`);
6. data parallelism and ZeRO: the DeepSpeed engine (`deepspeed_engine.py`).
Recurrence checkpointing is a model setting (`model.checkpoint_recurrence`), not applied here: it
recomputes one step of the recurrence loop, which exists only inside the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch.distributed as dist

from grt_megatron.device import run_device
from grt_megatron.model import GRTConfig, GRTLanguageModel
from grt_megatron.parallel.compile import apply_compile
from grt_megatron.parallel.deepspeed_engine import batch_layout, build_engine, clips_outside_deepspeed
from grt_megatron.parallel.mixed_precision import apply_mixed_precision
from grt_megatron.parallel.pipeline import GRTPipelineModule
from grt_megatron.parallel.sequence_parallel import register_sequence_parallel_grad_hooks
from grt_megatron.training.config import RunConfig


@dataclass
class ParallelModel:
    """The model as this rank runs it."""

    engine: deepspeed.DeepSpeedEngine
    """DeepSpeed's engine (a `PipelineEngine` when `pipelined`)."""
    pipelined: bool
    micro_batch: int
    accumulation: int
    """Micro-batches per optimizer step on this data-parallel rank."""
    clips_outside_deepspeed: bool
    """The step runner clips and measures the gradient norm itself (`clips_outside_deepspeed`)."""


def parallelize(model_config: GRTConfig, cfg: RunConfig) -> ParallelModel:
    """Build this rank's part of the model for `cfg`'s layout and wrap it in the data-parallel engine.
    Collective: every rank of the (initialised) world calls it."""
    dp_size = cfg.validate_layout(dist.get_world_size())
    pipelined = cfg.parallel.pp > 1
    if pipelined:
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        model = GRTPipelineModule(model_config, cfg.seed, cfg.parallel.pp, dp_size, cfg.seq_length,
                                  cfg.parallel.pp_split_points)
    else:
        model = GRTLanguageModel(model_config, init_seed=cfg.seed)
    if model_config.sequence_parallel:
        register_sequence_parallel_grad_hooks(model)
    apply_mixed_precision(model, cfg.train.precision, run_device())
    if cfg.train.compile:
        apply_compile(model)
    clip_outside = clips_outside_deepspeed(cfg)
    micro_batch, accumulation = batch_layout(cfg, dp_size)
    engine = build_engine(model, cfg, dp_size, clip_in_deepspeed=not clip_outside)
    return ParallelModel(engine, pipelined, micro_batch, accumulation, clip_outside)
