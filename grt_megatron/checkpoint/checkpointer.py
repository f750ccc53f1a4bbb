"""`save_checkpoint` / `load_checkpoint`: a running DeepSpeed engine to and from a checkpoint directory.

Collective: every rank calls them. Data-parallel rank 0 of each (TP rank, pipeline stage) writes that
shard's tensors; every rank writes its RNG states; rank 0 writes the trainer state, the tokenizer and
the manifest, and commits. Loading reads only JSON and safetensors: nothing is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_tensors

from grt_megatron.checkpoint.rng import capture_rng, restore_rng
from grt_megatron.checkpoint.state import (
    MOMENTS,
    VOCAB_TENSORS,
    CheckpointError,
    OptimizerState,
    fit_vocab_rows,
    full_shape,
    iter_state_tensors,
    merge_tp,
    named_parameters,
    partition_dim,
    split_tp,
)
from grt_megatron.checkpoint.store import TRAINER_STATE, PendingSave, prune, write_file
from grt_megatron.device import device_tensor


def shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def rng_name(rank: int) -> str:
    return f"rng/rank{rank:05d}.safetensors"


def _ranks(engine, pipelined: bool) -> tuple[int, int, int]:
    """(TP rank, pipeline stage, DP rank) of this process."""
    pp = engine.stage_id if pipelined else 0
    return parallel_state.get_tensor_model_parallel_rank(), pp, parallel_state.get_data_parallel_rank()


@torch.no_grad()
def save_checkpoint(root: Path, step: int, engine, pipelined: bool, tokenizer, trainer_state: dict[str, Any],
                    keep_last: int, permanent: bool = False) -> Path:
    """Write the engine's state at `step` under `root` atomically; returns the checkpoint directory."""
    rank = dist.get_rank()
    pending = PendingSave(root, step)
    if rank == 0:
        pending.prepare()
    dist.barrier()
    tp_rank, pp_rank, dp_rank = _ranks(engine, pipelined)
    params = named_parameters(engine.module, pipelined)
    optimizer = OptimizerState(engine)
    # Gathering is collective over DP: every DP rank walks the tensors, rank 0 keeps them.
    tensors = {key: t.detach().to("cpu", torch.float32).contiguous()
               for key, t in iter_state_tensors(optimizer, params)}
    files: dict[str, dict[str, Any]] = {}
    if dp_rank == 0:
        meta = {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank),
                "partition_dims": json.dumps({name: partition_dim(p) for name, p in params})}
        files[shard_name(tp_rank, pp_rank)] = write_file(pending.tmp / shard_name(tp_rank, pp_rank),
                                                          save_tensors(tensors, metadata=meta))
    del tensors
    files[rng_name(rank)] = write_file(pending.tmp / rng_name(rank), capture_rng())
    if rank == 0:
        state = {**trainer_state, "optimizer_steps": optimizer.step_count(),
                 "lr_scheduler": {k: v for k, v in engine.lr_scheduler.state_dict().items() if k != "lr_lambdas"}}
        files[TRAINER_STATE] = write_file(pending.tmp / TRAINER_STATE, json.dumps(state, indent=2).encode())
        files.update(pending.add_tokenizer(tokenizer))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    final = pending.root / pending.name
    if rank == 0:
        final = pending.commit({k: v for part in gathered for k, v in part.items()}, permanent)
        prune(pending.root, keep_last)
    dist.barrier()
    return final


class ShardIndex:
    """Which saved shard file holds which tensor, for every saved (TP rank, stage)."""

    def __init__(self, path: Path, state: dict[str, Any]):
        self.tp = int(state["layout"]["tp"])
        self.files: dict[int, list] = {}  # stage -> handles in TP rank order
        self.dims: dict[str, int] = {}
        try:
            for pp in range(int(state["layout"]["pp"])):
                handles = [safe_open(str(path / shard_name(t, pp)), framework="pt") for t in range(self.tp)]
                self.files[pp] = handles
                self.dims.update(json.loads(handles[0].metadata()["partition_dims"]))
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable tensor shard ({err})") from None
        self.where = {}
        for pp in sorted(self.files, reverse=True):  # the lowest stage holding a name wins (tied copies)
            for key in self.files[pp][0].keys():
                self.where[key] = pp

    def full(self, key: str, dim: int):
        """The tensor `key` whole across TP (`dim`: its partition dimension), or None if not saved."""
        pp = self.where.get(key)
        if pp is None:
            return None
        return merge_tp([h.get_tensor(key) for h in self.files[pp]], dim)


@torch.no_grad()
def load_checkpoint(path: Path, engine, pipelined: bool, padded_vocab_size: int, restore_rngs: bool) -> dict[str, Any]:
    """Load a checkpoint (any layout) into the engine; returns its trainer state, with `rng_restored`.

    `restore_rngs`: the layout is the one saved (same world, TP, PP), so each rank gets its own RNG
    states back (if the checkpoint has them); otherwise the caller reseeds."""
    path = Path(path)
    state = json.loads((path / TRAINER_STATE).read_text())
    index = ShardIndex(path, state)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    optimizer = OptimizerState(engine)
    optimizer.materialize()
    for name, p in named_parameters(engine.module, pipelined):
        dim = partition_dim(p)  # the same model: the saved shards were split along the same dimension
        for key in (None, *MOMENTS):
            full = index.full(f"{key or 'param'}/{name}", dim)
            if full is None:
                if key is None:
                    raise CheckpointError(f"{path}: holds no weights for parameter {name} of this model")
                # A moment never created (the parameter never had a gradient); a host tensor like the
                # ones read from the file, moved to the parameter's device below.
                full = torch.zeros((), device="cpu")
            if full.ndim and name in VOCAB_TENSORS:
                full = fit_vocab_rows(full, padded_vocab_size)
            local = split_tp(full, dim, tp_rank, tp_size) if full.ndim else full.expand(full_shape(p))
            if tuple(local.shape) != tuple(full_shape(p)):
                raise CheckpointError(f"{path}: {name} has shape {tuple(local.shape)} on this rank, the model "
                                      f"expects {tuple(full_shape(p))}")
            optimizer.set(p, key, local.to(p.device))
    optimizer.set_step_count(int(state["optimizer_steps"]))
    _restore_schedule(engine, state)
    # An imported checkpoint has no RNG states; every rank must agree on whether they are restored.
    restored = device_tensor([int(restore_rngs and (path / rng_name(dist.get_rank())).is_file())])
    dist.all_reduce(restored, op=dist.ReduceOp.MIN)
    if restored.item():
        restore_rng(path / rng_name(dist.get_rank()))
    return {**state, "rng_restored": bool(restored.item())}


def _restore_schedule(engine, state: dict[str, Any]) -> None:
    """The LR schedule's position; the rate itself comes from the current config's schedule (a changed
    `train.iters` or `decay_iters` applies from the next step)."""
    scheduler = engine.lr_scheduler
    saved = state["lr_scheduler"]
    scheduler.last_epoch = int(saved["last_epoch"])
    scheduler._step_count = int(saved.get("_step_count", scheduler.last_epoch + 1))
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    engine.global_steps = int(state["step"])
    engine.global_samples = int(state["consumed_samples"])
    engine.micro_steps = int(state["step"]) * engine.gradient_accumulation_steps()
