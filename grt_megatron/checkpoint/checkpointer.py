"""`save_checkpoint` / `load_checkpoint`: a running DeepSpeed engine to and from a checkpoint directory.

Collective: every rank calls them. Data-parallel rank 0 of each (TP rank, pipeline stage) writes that
shard's tensors; every rank writes its RNG states; rank 0 writes the trainer state, the tokenizer and
the manifest, and commits. Loading reads only JSON and safetensors: nothing is unpickled.

A save that fails on any rank (an OSError: full disk, no permission, read-only or failing storage) fails
on every rank with the same `CheckpointWriteError`, after rank 0 removed the partial directory: ranks
exchange their outcome in the save's collectives, so none waits for a rank that gave up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

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
from grt_megatron.checkpoint.store import (
    TRAINER_STATE,
    PendingSave,
    free_bytes,
    os_failure,
    prune,
    write_error,
    write_file,
)
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
    """Write the engine's state at `step` under `root` atomically; returns the checkpoint directory.
    Raises CheckpointWriteError on every rank if any rank could not write (nothing of the save is left)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pending = PendingSave(root, step)
    # Rank 0 makes the temporary directory. Broadcasting whether it could (rather than a barrier) keeps
    # the others from writing into a directory that is not there.
    failure = _broadcast(_attempt(pending.prepare, rank, pending.root) if rank == 0 else None)
    payloads = _serialize(engine, pipelined, trainer_state, rank)
    # The size is known before anything is written, so that a full disk's error can say what it needs
    # (a Hugging Face tokenizer folder's size is not: it counts as nothing, the size is "about").
    planned = sum(map(len, payloads.values())) + (len(getattr(tokenizer, "model_proto", b"")) if rank == 0 else 0)
    files: dict[str, dict[str, Any]] = {}
    if failure is None:
        failure = _attempt(lambda: _write(pending, payloads, tokenizer if rank == 0 else None, files), rank,
                           pending.root)
    payloads.clear()  # the serialized shard is as large as the tensors: not kept past the writing
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"files": files, "bytes": planned, "failure": failure})
    needed = sum(part["bytes"] for part in gathered)
    failure = next((part["failure"] for part in gathered if part["failure"]), None)  # the lowest rank's
    if rank == 0:
        if failure is None:
            every_file = {k: v for part in gathered for k, v in part["files"].items()}
            failure = _attempt(lambda: pending.commit(every_file, permanent), rank, pending.root)
        if failure is None:
            _prune(pending.root, keep_last)
        else:
            pending.discard()
    # The commit's outcome (rather than a barrier): after it the save is in place, or gone, on every rank.
    failure = _broadcast(failure)
    if failure is not None:
        raise write_error(pending.name, pending.root, failure, needed, world)
    return pending.root / pending.name


def _serialize(engine, pipelined: bool, trainer_state: dict[str, Any], rank: int) -> dict[str, bytes]:
    """This rank's files as bytes: its shard's tensors (DP rank 0 of each shard), its RNG states, and on
    rank 0 the trainer state. Gathering the tensors is collective over DP: every DP rank walks them."""
    tp_rank, pp_rank, dp_rank = _ranks(engine, pipelined)
    params = named_parameters(engine.module, pipelined)
    optimizer = OptimizerState(engine)
    tensors = {key: t.detach().to("cpu", torch.float32).contiguous()
               for key, t in iter_state_tensors(optimizer, params)}
    payloads = {}
    if dp_rank == 0:
        meta = {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank),
                "partition_dims": json.dumps({name: partition_dim(p) for name, p in params})}
        payloads[shard_name(tp_rank, pp_rank)] = save_tensors(tensors, metadata=meta)
    del tensors
    payloads[rng_name(rank)] = capture_rng()
    if rank == 0:
        state = {**trainer_state, "optimizer_steps": optimizer.step_count(),
                 "lr_scheduler": {k: v for k, v in engine.lr_scheduler.state_dict().items() if k != "lr_lambdas"}}
        payloads[TRAINER_STATE] = json.dumps(state, indent=2).encode()
    return payloads


def _write(pending: PendingSave, payloads: dict[str, bytes], tokenizer, files: dict[str, dict[str, Any]]) -> None:
    """Write this rank's files (and the tokenizer, on rank 0) into the save's temporary directory."""
    for name, data in payloads.items():
        files[name] = write_file(pending.tmp / name, data)
    if tokenizer is not None:
        files.update(pending.add_tokenizer(tokenizer))


def _attempt(action: Callable[[], Any], rank: int, root: Path) -> Optional[dict[str, Any]]:
    """None if `action` succeeded, else its OSError as data for the other ranks, with the free space
    measured before it ran (after a full disk's failure there is none left: that is not the news)."""
    free = free_bytes(root)
    try:
        action()
    except OSError as err:
        return os_failure(err, rank, free)
    return None


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _prune(root: Path, keep_last: int) -> None:
    """Pruning comes after the new checkpoint is in place: failing to delete an old one is a warning."""
    try:
        prune(root, keep_last)
    except OSError as err:
        print(f"checkpoint: warning: could not remove old checkpoints under {root}: {err}", file=sys.stderr,
              flush=True)


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
