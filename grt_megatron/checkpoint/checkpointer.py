"""`save_checkpoint` / `load_checkpoint`: a running DeepSpeed engine to and from a checkpoint directory.

Collective: every rank calls them. Every rank writes, in parallel and without communicating, the part of
its (TP rank, pipeline stage)'s fp32 weights and Adam moments that it holds: its ZeRO partition (as flat
pieces `KEY#START` of the flattened tensor), or, where data-parallel ranks hold replicas, the whole
tensors assigned to it (balanced by bytes). It streams them tensor by tensor from the device into its
file, hashing on the way, so a rank's host memory holds one tensor at a time, not its part nor the shard.
Every rank also writes its RNG states; rank 0 writes the trainer state, the tokenizer and the manifest
(every rank's files with the sizes and hashes it measured), and commits. Loading reads only JSON and
safetensors: nothing is unpickled; a rank that resumes at the saved TP size reads only its own TP shard.

A save that fails on any rank (an OSError: full disk, no permission, read-only or failing storage) fails
on every rank with the same `CheckpointWriteError`, after rank 0 removed the partial directory: ranks
exchange their outcome in the save's collectives, so none waits for a rank that gave up.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import SafetensorError, safe_open

from grt_megatron.checkpoint.rng import capture_rng, restore_rng, rng_fits_this_device
from grt_megatron.checkpoint.state import (
    MOMENTS,
    VOCAB_TENSORS,
    CheckpointError,
    OptimizerState,
    fit_vocab_rows,
    full_shape,
    merge_tp,
    named_parameters,
    partition_dim,
    split_tp,
)
from grt_megatron.checkpoint.store import (
    TRAINER_STATE,
    PendingSave,
    balanced_owners,
    free_bytes,
    os_failure,
    prune,
    write_error,
    write_file,
    write_stream,
)
from grt_megatron.device import device_tensor


def shard_name(tp_rank: int, pp_rank: int, dp_rank: int = 0) -> str:
    """DP rank 0's file of a (TP rank, stage) keeps format 1's name; the other DP ranks' parts add `-dpNNN`."""
    part = f"-dp{dp_rank:03d}" if dp_rank else ""
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}{part}.safetensors"


def shard_files(path: Path, tp_rank: int, pp_rank: int) -> list[Path]:
    return sorted(path.glob(f"model-tp{tp_rank:02d}-pp{pp_rank:02d}*.safetensors"))


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
    return write_snapshot(snapshot_checkpoint(root, step, engine, pipelined, tokenizer, trainer_state, keep_last,
                                              permanent, copy=False))


@dataclass
class SaveSnapshot:
    """Everything one rank writes for one checkpoint, taken at the step (`snapshot_checkpoint`)."""

    pending: PendingSave
    shard: "ShardPart"
    payloads: dict[str, bytes]
    tokenizer: Any
    keep_last: int
    permanent: bool

    @property
    def path(self) -> Path:
        return self.pending.root / self.pending.name


@torch.no_grad()
def snapshot_checkpoint(root: Path, step: int, engine, pipelined: bool, tokenizer, trainer_state: dict[str, Any],
                        keep_last: int, permanent: bool = False, copy: bool = True) -> SaveSnapshot:
    """This rank's part of the checkpoint at `step`, without writing or communicating anything: its RNG
    states and (rank 0) the trainer state as bytes, and its tensors, copied to host memory (pinned on CUDA)
    with `copy` so that training may go on while a background writer writes them (`AsyncSaver`)."""
    rank = dist.get_rank()
    shard = ShardPart(engine, pipelined)
    if copy:
        shard.copy_to_host()
    return SaveSnapshot(PendingSave(root, step), shard, _serialize(engine, pipelined, trainer_state, rank),
                        tokenizer if rank == 0 else None, keep_last, permanent)


def write_snapshot(snapshot: SaveSnapshot, group=None) -> Path:
    """Write a snapshot and commit it: collective over `group` (every rank, default the world's group; a
    background writer uses a group of its own so that its collectives never interleave with training's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pending, shard, payloads = snapshot.pending, snapshot.shard, snapshot.payloads
    # Rank 0 makes the temporary directory. Broadcasting whether it could (rather than a barrier) keeps
    # the others from writing into a directory that is not there.
    failure = _broadcast(_attempt(pending.prepare, rank, pending.root) if rank == 0 else None, group)
    # The size is known before anything is written, so that a full disk's error can say what it needs
    # (a Hugging Face tokenizer folder's size is not: it counts as nothing, the size is "about").
    planned = sum(map(len, payloads.values())) + shard.bytes + len(getattr(snapshot.tokenizer, "model_proto", b""))
    files: dict[str, dict[str, Any]] = {}
    if failure is None:
        failure = _attempt(lambda: _write(pending, payloads, shard, snapshot.tokenizer, files), rank, pending.root)
    shard.release()  # a snapshot's host copy is not kept past its writing
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"files": files, "bytes": planned, "failure": failure}, group=group)
    needed = sum(part["bytes"] for part in gathered)
    failure = next((part["failure"] for part in gathered if part["failure"]), None)  # the lowest rank's
    if rank == 0:
        if failure is None:
            every_file = {k: v for part in gathered for k, v in part["files"].items()}
            failure = _attempt(lambda: pending.commit(every_file, snapshot.permanent), rank, pending.root)
        if failure is None:
            _prune(pending.root, snapshot.keep_last)
        else:
            pending.discard()
    # The commit's outcome (rather than a barrier): after it the save is in place, or gone, on every rank.
    failure = _broadcast(failure, group)
    if failure is not None:
        raise write_error(pending.name, pending.root, failure, needed, world)
    return snapshot.path


class ShardPart:
    """What this rank writes of its (TP rank, stage): the tensors' names, shapes and where each comes from
    (views of the optimizer's state: nothing is copied until it is written), and the safetensors header."""

    def __init__(self, engine, pipelined: bool):
        tp_rank, pp_rank, dp_rank = _ranks(engine, pipelined)
        params = named_parameters(engine.module, pipelined)
        optimizer = OptimizerState(engine)
        # Replicated parameters (no ZeRO) are written by one DP rank each, balanced by size.
        owners = balanced_owners({name: math.prod(full_shape(p)) for name, p in params},
                                 parallel_state.get_data_parallel_world_size())
        self.tensors: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        for name, p in params:
            shape = tuple(full_shape(p))
            for key in (None, *MOMENTS):
                pieces = optimizer.own_pieces(p, key, owner=owners[name] == dp_rank)
                for start, piece in pieces or ():
                    whole = start == 0 and piece.numel() == math.prod(shape)
                    label = f"{key or 'param'}/{name}" + ("" if whole else f"#{start}")
                    self.tensors.append((label, shape if whole else (piece.numel(),), piece))
        self.name = shard_name(tp_rank, pp_rank, dp_rank)
        # DP rank 0 always writes its file (the shard's metadata); another rank only if it holds something.
        self.empty = dp_rank != 0 and not self.tensors
        meta = {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank), "dp_rank": str(dp_rank),
                "partition_dims": json.dumps({name: partition_dim(p) for name, p in params}),
                "shapes": json.dumps({name: list(full_shape(p)) for name, p in params})}
        self.header = safetensors_header([(label, shape) for label, shape, _ in self.tensors], meta)
        self.bytes = 0 if self.empty else len(self.header) + sum(4 * math.prod(s) for _, s, _ in self.tensors)

    def copy_to_host(self) -> None:
        """Replace the views of the optimizer's state by host copies (pinned on CUDA, so that the copies
        run at full speed); training may change the originals afterwards."""
        copies = []
        for label, shape, piece in self.tensors:
            pinned = piece.is_cuda
            host = torch.empty(piece.shape, dtype=torch.float32, device="cpu", pin_memory=pinned)
            host.copy_(piece.detach(), non_blocking=pinned)
            copies.append((label, shape, host))
        if any(piece.is_cuda for _, _, piece in self.tensors):
            torch.cuda.synchronize()  # the copies are complete before the optimizer's next step
        self.tensors = copies

    def release(self) -> None:
        self.tensors = [(label, shape, None) for label, shape, _ in self.tensors]

    def chunks(self) -> Iterator:
        """The file's bytes: the header, then each tensor, brought to the host one at a time."""
        yield self.header
        for _, _, piece in self.tensors:
            yield piece.detach().to("cpu", torch.float32).contiguous().numpy()


def safetensors_header(tensors: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """A safetensors header for fp32 `tensors` laid out in this order: the 8-byte little-endian length,
    then the JSON (names, dtype, shape, byte offsets), padded with spaces to 8 bytes as the format wants."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for label, shape in tensors:
        size = 4 * math.prod(shape)
        header[label] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _serialize(engine, pipelined: bool, trainer_state: dict[str, Any], rank: int) -> dict[str, bytes]:
    """This rank's small files as bytes: its RNG states and, on rank 0, the trainer state."""
    payloads = {rng_name(rank): capture_rng()}
    if rank == 0:
        optimizer = OptimizerState(engine)
        state = {**trainer_state, "optimizer_steps": optimizer.step_count(),
                 "lr_scheduler": {k: v for k, v in engine.lr_scheduler.state_dict().items() if k != "lr_lambdas"}}
        payloads[TRAINER_STATE] = json.dumps(state, indent=2).encode()
    return payloads


def _write(pending: PendingSave, payloads: dict[str, bytes], shard: ShardPart, tokenizer,
           files: dict[str, dict[str, Any]]) -> None:
    """Write this rank's files (and the tokenizer, on rank 0) into the save's temporary directory."""
    if not shard.empty:
        files[shard.name] = write_stream(pending.tmp / shard.name, shard.chunks())
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


def _broadcast(value, group=None):
    """Rank 0's `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _prune(root: Path, keep_last: int) -> None:
    """Pruning comes after the new checkpoint is in place: failing to delete an old one is a warning."""
    try:
        prune(root, keep_last)
    except OSError as err:
        print(f"checkpoint: warning: could not remove old checkpoints under {root}: {err}", file=sys.stderr,
              flush=True)


_PIECE = re.compile(r"^(.+)#(\d+)$")


class ShardIndex:
    """Which saved file holds which tensor (or which pieces of it), for every saved (TP rank, stage)."""

    def __init__(self, path: Path, state: dict[str, Any]):
        self.path = path
        self.tp = int(state["layout"]["tp"])
        stages = int(state["layout"]["pp"])
        # (stage, TP rank) -> key -> [(file handle, stored name, first element or None for a whole tensor)]
        self.pieces: dict[tuple[int, int], dict[str, list]] = {}
        self.shapes: dict[tuple[int, int], dict[str, list[int]]] = {}
        self.dims: dict[str, int] = {}
        try:
            for pp in range(stages):
                for t in range(self.tp):
                    files = shard_files(path, t, pp)
                    if not files:
                        raise CheckpointError(f"{path}: no tensor file for TP rank {t}, stage {pp}")
                    table, shapes = {}, {}
                    for file in files:
                        handle = safe_open(str(file), framework="pt")
                        meta = handle.metadata() or {}
                        self.dims.update(json.loads(meta["partition_dims"]))
                        shapes.update(json.loads(meta.get("shapes", "{}")))  # format 1 has whole tensors only
                        for stored in handle.keys():
                            match = _PIECE.match(stored)
                            key, start = (match.group(1), int(match.group(2))) if match else (stored, None)
                            table.setdefault(key, []).append((handle, stored, start))
                    self.pieces[(pp, t)], self.shapes[(pp, t)] = table, shapes
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable tensor shard ({err})") from None
        self.where = {}
        for pp in reversed(range(stages)):  # the lowest stage holding a name wins (tied copies)
            for key in self.pieces[(pp, 0)]:
                self.where[key] = pp

    def tp_shard(self, key: str, pp: int, t: int) -> Optional[torch.Tensor]:
        """`key` as TP rank `t` of stage `pp` held it, assembled from its pieces; None if not saved."""
        entries = self.pieces[(pp, t)].get(key)
        if not entries:
            return None
        if len(entries) == 1 and entries[0][2] is None:
            handle, stored, _ = entries[0]
            return handle.get_tensor(stored)
        shape = self.shapes[(pp, t)].get(key.split("/", 1)[1])
        if shape is None or any(start is None for _, _, start in entries):
            raise CheckpointError(f"{self.path}: {key} of TP rank {t}, stage {pp} mixes whole and partial copies")
        flat = torch.empty(math.prod(shape), dtype=torch.float32, device="cpu")  # read from the files
        end = 0
        for handle, stored, start in sorted(entries, key=lambda e: e[2]):
            piece = handle.get_tensor(stored).reshape(-1)
            if start != end:
                break
            flat[start : start + piece.numel()] = piece
            end = start + piece.numel()
        if end != flat.numel():
            raise CheckpointError(f"{self.path}: the pieces of {key} (TP rank {t}, stage {pp}) cover elements "
                                  f"0..{end} of {flat.numel()} contiguously; a part is missing")
        return flat.view(shape)

    def full(self, key: str, dim: int) -> Optional[torch.Tensor]:
        """The tensor `key` whole across TP (`dim`: its partition dimension), or None if not saved."""
        pp = self.where.get(key)
        if pp is None:
            return None
        if dim < 0:  # replicated over TP: one copy is the tensor
            return self.tp_shard(key, pp, 0)
        return merge_tp([self.tp_shard(key, pp, t) for t in range(self.tp)], dim)

    def flat_range(self, key: str, t: int, start: int, count: int) -> Optional[torch.Tensor]:
        """Elements [start, start + count) of the flattened `key` of TP rank `t`, reading only the byte
        ranges of its pieces that overlap them (row slices of a whole tensor); None if not saved."""
        pp = self.where.get(key)
        entries = None if pp is None else self.pieces[(pp, t)].get(key)
        if not entries:
            return None
        out = torch.empty(count, dtype=torch.float32, device="cpu")  # read from the files
        end, filled = start + count, 0
        for handle, stored, first in entries:
            piece = handle.get_slice(stored)
            shape = piece.get_shape()
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            base = first or 0
            lo, hi = max(start, base), min(end, base + math.prod(shape))
            if lo >= hi:
                continue
            r0, r1 = (lo - base) // row, -(-(hi - base) // row)  # the rows (or elements) that hold [lo, hi)
            values = piece[r0:r1].reshape(-1)
            out[lo - start : hi - start] = values[lo - base - r0 * row : hi - base - r0 * row]
            filled += hi - lo
        if filled != count:
            raise CheckpointError(f"{self.path}: the pieces of {key} (TP rank {t}) cover {filled} of the {count} "
                                  f"elements from {start} this rank needs")
        return out

    def local(self, key: str, dim: int, tp_rank: int, tp_size: int) -> Optional[torch.Tensor]:
        """This TP rank's part of `key`: at the saved TP size, read from its own TP shard alone."""
        pp = self.where.get(key)
        if pp is None:
            return None
        if dim < 0 or tp_size == self.tp:
            return self.tp_shard(key, pp, 0 if dim < 0 else tp_rank)
        full = self.full(key, dim)
        return split_tp(full, dim, tp_rank, tp_size)


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
            label = f"{key or 'param'}/{name}"
            held = optimizer.own_range(p) if key is not None else None
            if held is not None and tp_size == index.tp and name not in VOCAB_TENSORS:
                # A ZeRO partition's moments: only the elements this rank holds are read.
                values = index.flat_range(label, tp_rank, *held) if held[1] else None
                optimizer.set_moment_range(p, key, held[0], values.to(p.device) if values is not None else None)
                continue
            if name in VOCAB_TENSORS:  # the padded rows depend on the TP size: fitted on the whole tensor
                local = index.full(label, dim)
                if local is not None and local.ndim:
                    local = split_tp(fit_vocab_rows(local, padded_vocab_size), dim, tp_rank, tp_size)
            else:
                local = index.local(label, dim, tp_rank, tp_size)
            if local is None:
                if key is None:
                    raise CheckpointError(f"{path}: holds no weights for parameter {name} of this model")
                # A moment never created (the parameter never had a gradient); a host tensor like the
                # ones read from the file, moved to the parameter's device below.
                local = torch.zeros((), device="cpu")
            if not local.ndim:
                local = local.expand(full_shape(p))
            if tuple(local.shape) != tuple(full_shape(p)):
                raise CheckpointError(f"{path}: {name} has shape {tuple(local.shape)} on this rank, the model "
                                      f"expects {tuple(full_shape(p))}")
            optimizer.set(p, key, local.to(p.device))
    optimizer.set_step_count(int(state["optimizer_steps"]))
    _restore_schedule(engine, state)
    # An imported checkpoint has no RNG states, and states drawn on another kind of device (a CPU checkpoint
    # resumed on a GPU) do not fit this one's generators; every rank must agree on whether they are restored.
    rng_file = path / rng_name(dist.get_rank())
    restored = device_tensor([int(restore_rngs and rng_file.is_file() and rng_fits_this_device(rng_file))])
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
