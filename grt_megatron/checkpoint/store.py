"""Checkpoint directories on disk: atomic commits, manifests, the `latest` pointer, listing and pruning.

    RUN_DIR/checkpoints/
        step_00000200/                  one complete checkpoint
            manifest.json               size and sha256 of every file below; written last
            trainer_state.json          step, samples, schedule, layout, resolved config, tokenizer, version
            model-tp00-pp00.safetensors fp32 weights + Adam moments of one (TP rank, pipeline stage) that
            model-tp00-pp00-dp001.safetensors  DP rank 0 holds, and those each other DP rank holds (format 2)
            rng/rank00000.safetensors   each rank's RNG states
            tokenizer.model             the run's tokenizer
            PERMANENT                   (optional) never pruned
        latest                          name of the newest checkpoint (for people and tools)
        .tmp-step_00000300/             a save in progress (or killed): never read
        .pruned-step_00000100/          an old checkpoint being deleted (or killed while deleted): never read

A save writes into `.tmp-step_N`, fsyncs every file, writes the manifest, renames the directory to
`step_N` and fsyncs its parent; `latest` changes after that. A directory named `step_N` therefore always
has its manifest; whether its files still match it is checked before it is used. A save that fails (a
full disk, no permission, read-only or failing storage) is undone: its temporary directory is removed,
`latest` and the earlier checkpoints stay as they were, and `CheckpointWriteError` says why in one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from grt_megatron.files import fsync_dir

FORMAT = "grt-megatron-checkpoint"
FORMAT_VERSION = 2
# 1: each (TP rank, stage) in one file written by its DP rank 0. 2: each DP rank writes the part it holds
# (ZeRO partitions as flat pieces `KEY#START`); a file of version 1 reads as a version-2 file of whole tensors.
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
PERMANENT = "PERMANENT"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, foreign or incompatible."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (its partial files removed; earlier checkpoints untouched)."""


# Errors that more free space would cure: their message says how much is needed and how much is free.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    """`300 KiB`, `1.2 MiB`: two significant digits are enough to compare a need with what is free."""
    n, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} {unit}" if unit == "B" or n >= 10 else f"{n:.1f} {unit}"


def free_bytes(path: Path) -> Optional[int]:
    """Free space on the file system of `path` (or of its nearest existing parent); None if unknown."""
    for candidate in (Path(path), *Path(path).parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def os_failure(err: OSError, rank: int, free: Optional[int]) -> dict[str, Any]:
    """An OSError as plain data: it travels to the other ranks (all_gather_object) to be raised there too."""
    text = os.strerror(err.errno) if err.errno else str(err)
    return {"rank": rank, "errno": err.errno, "text": text[:1].lower() + text[1:], "file": err.filename,
            "free": free}


def write_error(name: str, root: Path, failure: dict[str, Any], needed: int, world_size: int) -> CheckpointWriteError:
    """The one-line error every rank raises for a failed save (built from the same data on every rank)."""
    where = f" on rank {failure['rank']}" if world_size > 1 else ""
    detail = f"needs about {human_bytes(needed)}"
    if failure["errno"] in _NO_SPACE and failure["free"] is not None:
        detail += f", {human_bytes(failure['free'])} free"
    elif failure["file"]:
        detail = f"{failure['file']}; " + detail  # which path was refused says which permission to fix
    return CheckpointWriteError(f"could not write checkpoint {name} under {root}: {failure['text']}{where} "
                                f"({detail})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write and fsync `data`; returns its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_stream(path: Path, chunks: Iterable) -> dict[str, Any]:
    """Write and fsync the byte chunks (bytes or buffers) one after the other, hashing them on the way, so
    that a file larger than memory never exists in memory whole; returns its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            f.write(view)
            digest.update(view)
            size += view.nbytes
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_text_atomic(path: Path, text: str) -> None:
    """Like `files.write_atomic(durable=True)`, but through `write_file`: every byte of a checkpoint goes
    through that one function (where a full disk is reported, and where tests inject faults)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_file(tmp, text.encode())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a half-written temporary file would only take up room
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: not a grt-megatron checkpoint (no {path.name})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return value


# ---- one checkpoint -----------------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    path: Path
    step: int
    complete: bool
    problem: Optional[str] = None
    state: dict[str, Any] = field(default_factory=dict)
    bytes: int = 0
    permanent: bool = False
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # the manifest's entries


def inspect_checkpoint(path: Path, verify_hashes: bool = False) -> CheckpointInfo:
    """What a checkpoint directory holds and whether it can be used. Sizes are always checked;
    content hashes with `verify_hashes` (reads every file)."""
    path = Path(path)
    match = _STEP_DIR.match(path.name)
    info = CheckpointInfo(path=path, step=int(match.group(1)) if match else -1, complete=False,
                          permanent=(path / PERMANENT).exists())
    try:
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint directory")
        manifest = read_json(path / MANIFEST, "the manifest")
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a grt-megatron checkpoint (manifest format "
                                  f"{manifest.get('format')!r})")
        if manifest.get("format_version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{path}: checkpoint format version {manifest.get('format_version')} is not "
                                  f"supported (this grt-megatron reads versions "
                                  f"{', '.join(map(str, READABLE_VERSIONS))})")
        files = manifest.get("files")
        if not isinstance(files, dict) or TRAINER_STATE not in files:
            raise CheckpointError(f"{path}: manifest lists no {TRAINER_STATE}")
        for name, entry in sorted(files.items()):
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{path}: {name} is missing")
            size = file.stat().st_size
            if size != entry.get("bytes"):
                raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {entry.get('bytes')}")
            info.bytes += size
        info.files = files
        if verify_hashes and (problem := verify_files(path, files)):
            raise CheckpointError(problem)
        info.state = read_json(path / TRAINER_STATE, "the trainer state")
        info.step = int(info.state.get("step", info.step))
        info.complete = True
    except CheckpointError as err:
        info.problem = str(err)
    return info


def verify_files(path: Path, files: dict[str, dict[str, Any]], names: Optional[Iterable[str]] = None
                 ) -> Optional[str]:
    """The first of `names` (default: all) whose content does not match its sha256 in the manifest, as a
    one-line problem; None when all match."""
    for name in sorted(files if names is None else names):
        if file_entry(Path(path) / name)["sha256"] != files[name].get("sha256"):
            return f"{path}: {name} does not match its sha256 in the manifest (corrupt)"
    return None


def balanced_owners(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Which of `ranks` takes each named item: largest first to the least-loaded rank (ties to the lowest
    rank, then by name), the same on every rank."""
    load = [0] * ranks
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


def verification_shares(files: dict[str, dict[str, Any]], ranks: int) -> list[list[str]]:
    """The manifest's files split over `ranks` verifiers by bytes (`balanced_owners`), the same on every
    rank: hashing a large checkpoint is spread instead of done by one rank alone."""
    owners = balanced_owners({name: int(entry.get("bytes", 0)) for name, entry in files.items()}, ranks)
    shares: list[list[str]] = [[] for _ in range(ranks)]
    for name in sorted(files, key=lambda n: (-int(files[n].get("bytes", 0)), n)):
        shares[owners[name]].append(name)
    return shares


Verifier = Callable[[Path, dict[str, dict[str, Any]]], Optional[str]]


# ---- a directory of checkpoints -------------------------------------------------------------------------
def list_checkpoints(root: Path, verify_hashes: bool = False) -> list[CheckpointInfo]:
    """Every `step_N` directory under `root`, oldest first (in-progress `.tmp-*` saves are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted((inspect_checkpoint(p, verify_hashes) for p in dirs), key=lambda c: c.step)


def checkpoint_root_of(path: Path) -> Path:
    """A run directory names its `checkpoints/` folder; a checkpoints folder names itself."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def newest_complete(root: Path, verify: Verifier = verify_files
                    ) -> tuple[Optional[CheckpointInfo], list[CheckpointInfo]]:
    """The newest checkpoint whose files all match their manifest, and the newer ones skipped (with why).
    `verify(path, files)` checks the hashes (here, or spread over a job's ranks)."""
    skipped = []
    for candidate in reversed(list_checkpoints(root)):
        if candidate.complete and (problem := verify(candidate.path, candidate.files)):
            candidate.complete, candidate.problem = False, problem
        if candidate.complete:
            return candidate, skipped
        skipped.append(candidate)
    return None, skipped


def resolve_checkpoint(spec: str, default_root: Path, option: str = "resume=", verify: Verifier = verify_files) \
        -> tuple[Optional[CheckpointInfo], list[CheckpointInfo]]:
    """`auto` (newest complete under `default_root`, None if there is none) or a path: a checkpoint
    directory, or a run / checkpoints directory (its newest complete checkpoint). Errors name the
    setting as `{option}{spec}` (`resume=...`, or a CLI flag such as `--checkpoint `)."""
    if spec == "auto":
        return newest_complete(default_root, verify)
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"{option}{spec}: no such file or directory")
    if (path / MANIFEST).exists() or path.is_file() or _STEP_DIR.match(path.name):
        info = inspect_checkpoint(path)
        if info.complete and (problem := verify(info.path, info.files)):
            info.complete, info.problem = False, problem
        if not info.complete:
            raise CheckpointError(f"{option}{spec}: {info.problem}")
        return info, []
    found, skipped = newest_complete(checkpoint_root_of(path), verify)
    if found is None:
        raise CheckpointError(f"{option}{spec}: no complete checkpoint in {checkpoint_root_of(path)}"
                              + "".join(f"\n  skipped {s.path.name}: {s.problem}" for s in skipped))
    return found, skipped


def checkpoint_dir(spec: str, option: str = "--checkpoint ") -> tuple[Path, list[CheckpointInfo]]:
    """A command's `--checkpoint`: a checkpoint directory as given (whoever reads it verifies its files),
    or a run / checkpoints directory's newest complete checkpoint, with the newer ones skipped (and why)."""
    path = Path(spec)
    if path.exists() and ((path / MANIFEST).exists() or path.is_file() or _STEP_DIR.match(path.name)):
        return path, []
    found, skipped = resolve_checkpoint(str(path), path, option)
    if found is None:
        raise CheckpointError(f"{option}{spec}: no complete checkpoint in {checkpoint_root_of(path)}")
    return found.path, skipped


# ---- writing ---------------------------------------------------------------------------------------------
class PendingSave:
    """A checkpoint being written: every rank writes its files into `tmp`; rank 0 commits."""

    def __init__(self, root: Path, step: int):
        self.root = Path(root)
        self.name = step_dir_name(step)
        self.tmp = self.root / f".tmp-{self.name}"

    def prepare(self) -> None:
        """Rank 0, before the others write: a clean temporary directory (stale ones, and half-deleted
        pruned checkpoints, are from killed saves)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in (*self.root.glob(".tmp-step_*"), *self.root.glob(".pruned-step_*")):
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp.mkdir()

    def add_tokenizer(self, tokenizer) -> dict[str, dict[str, Any]]:
        """Save the tokenizer into the checkpoint (a file, or a folder for HF tokenizers), fsynced;
        returns the manifest entries of what it wrote."""
        saved = tokenizer.save(self.tmp / tokenizer.file_name)
        entries = {}
        for file in ([saved] if saved.is_file() else sorted(p for p in saved.rglob("*") if p.is_file())):
            fsync_file(file)
            entries[str(file.relative_to(self.tmp))] = file_entry(file)
        return entries

    def discard(self) -> None:
        """Rank 0, after a failed save: remove what the ranks wrote."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, files: dict[str, dict[str, Any]], permanent: bool) -> Path:
        """Rank 0, after every rank wrote: manifest, rename into place, then `latest`. An OSError on the way
        undoes the save (`latest` and a same-step checkpoint saved before are put back) and is raised."""
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "files": dict(sorted(files.items()))}
        final, latest = self.root / self.name, self.root / LATEST
        replaced = self.root / f".replaced-{self.name}"
        before = _read_latest(latest)
        moved = {"replaced": False, "renamed": False}
        try:
            if permanent:
                write_file(self.tmp / PERMANENT, b"")
            write_file(self.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            for sub in {self.tmp, *(p.parent for p in (self.tmp / f for f in files))}:
                fsync_dir(sub)
            if final.exists():  # the same step saved before (a resumed run passing it again)
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
                moved["replaced"] = True
            os.rename(self.tmp, final)
            moved["renamed"] = True
            fsync_dir(self.root)
            write_text_atomic(latest, self.name + "\n")
        except OSError:
            self._undo(moved, replaced, before)
            raise
        if moved["replaced"]:
            shutil.rmtree(replaced, ignore_errors=True)
        return final

    def _undo(self, moved: dict[str, bool], replaced: Path, latest_before: Optional[str]) -> None:
        """Back to the state before the save, as far as the storage allows (each step best effort: the
        disk that failed the commit may fail these too, and the original error is the one to report)."""
        final, latest = self.root / self.name, self.root / LATEST
        with contextlib.suppress(OSError):
            if moved["renamed"]:
                os.rename(final, self.tmp)
        self.discard()
        with contextlib.suppress(OSError):
            if moved["replaced"]:
                os.rename(replaced, final)
        with contextlib.suppress(OSError):
            if _read_latest(latest) != latest_before:  # only when `latest` itself was written
                if latest_before is None:
                    latest.unlink()
                else:
                    write_text_atomic(latest, latest_before)


def _read_latest(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, sparing PERMANENT ones. Incomplete or
    corrupt directories are left for a person to look at (they are never picked for resuming)."""
    complete = [c for c in list_checkpoints(root) if c.complete]
    removed = []
    for old in complete[: max(0, len(complete) - keep_last)]:
        if not old.permanent:
            # Renamed first (atomic), then deleted: a kill during the deletion leaves a dot-directory the
            # next save removes, never a `step_N` with some of its files gone.
            doomed = old.path.with_name(f".pruned-{old.path.name}")
            os.rename(old.path, doomed)
            shutil.rmtree(doomed)
            removed.append(old.path)
    return removed


def supersede_newer(root: Path, step: int) -> list[Path]:
    """Move checkpoints newer than `step` (a timeline abandoned by resuming from an older checkpoint)
    into `superseded/`, so that `resume=auto` cannot jump back to them."""
    moved = []
    for c in list_checkpoints(root):
        if c.step > step:
            target = Path(root) / "superseded" / c.path.name
            target.parent.mkdir(exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(c.path, target)
            moved.append(target)
    return moved
