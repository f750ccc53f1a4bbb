"""Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`) written atomically, with a manifest, and checked.

Files are written under temporary names (`PREFIX.tmp-HOST-PID.*`) and renamed when complete, `.idx` last:
an `.idx` exists only beside a complete `.bin`, its manifest and (if the run trained one) its tokenizer, so
an interrupted preparation never leaves a prefix that training would accept. An error or a signal removes
the temporaries on the way out; those of a run killed outright (kill -9, out of memory, a crashed node) are
removed by the next run on the same prefix once it can prove the writer dead (same host, no such pid).
The `.bin/.idx` pair is megatron-core's own format (`IndexedDatasetBuilder`), readable by Megatron-LM's
`IndexedDataset`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from grt_megatron.data.sources import DataError
from grt_megatron.files import fsync_dir

META_SUFFIX = ".meta.json"
TOKENIZER_SUFFIX = ".tokenizer.model"
_TEMP_SUFFIXES = (".bin", ".idx", META_SUFFIX, TOKENIZER_SUFFIX, TOKENIZER_SUFFIX + ".tmp")


def prefix_paths(prefix: str | os.PathLike) -> dict[str, Path]:
    prefix = str(prefix)
    return {"bin": Path(prefix + ".bin"), "idx": Path(prefix + ".idx"), "meta": Path(prefix + META_SUFFIX),
            "tokenizer": Path(prefix + TOKENIZER_SUFFIX)}


def _host() -> str:
    # Several hosts may write into one shared filesystem, and their pids collide: the host is part of
    # every temporary name, so that a run only ever judges temporaries of its own host.
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def temp_prefix(prefix: str | os.PathLike, host: Optional[str] = None, pid: Optional[int] = None) -> str:
    """The prefix this process writes under until commit: `PREFIX.tmp-HOST-PID`."""
    return f"{prefix}.tmp-{host or _host()}-{pid or os.getpid()}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number that is not a pid
        return True
    return True


def remove_stale_temporaries(prefix: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of `prefix` that runs killed outright left behind, where provably dead:
    written on this host by a pid that no longer exists. Those of other hosts or of live processes (a
    concurrent run, or a pid reused since) are left alone. Returns the removed files."""
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        return []
    suffixes = "|".join(re.escape(s) for s in _TEMP_SUFFIXES)
    # Greedy host: a host name may itself hold "-digits"; the pid is the last such group.
    pattern = re.compile(re.escape(prefix.name) + rf"\.tmp-(?P<host>.+)-(?P<pid>\d+)(?:{suffixes})")
    host, removed = _host(), []
    for path in sorted(prefix.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and match["host"] == host and not _pid_alive(int(match["pid"])) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM back for a few steps that must not be cut in the middle (renames, cleanup);
    one received meanwhile is handed to its handler on exit. Handlers, not the signal mask: any thread may
    receive a signal, but Python runs its handlers in the main thread only, between bytecodes; elsewhere
    there is nothing to hold back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for signum in signums:
            if signal.getsignal(signum) is not None:  # None: a handler set outside Python, left alone
                previous[signum] = signal.signal(signum, lambda n, frame: caught.append(n))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # e.g. default_int_handler: raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                signal.raise_signal(caught[0])


def token_dtype(vocab_size: int) -> type:
    """megatron-core's choice: uint16 below 65,500 ids, int32 above."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_prefix(prefix: str | os.PathLike) -> None:
    """Refuse an output prefix that is a directory: `out/` would give the hidden files `out/.bin`, and an
    existing `out` was most likely meant as the folder to write into. And one whose folder cannot be
    made, before any time is spent on it."""
    text = str(prefix)
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if not text or text.endswith(seps) or Path(text).is_dir():
        example = os.path.join(text.rstrip("".join(seps)) or ".", "corpus")
        raise DataError(f"output prefix {text!r} names a directory; give a file-name prefix, e.g. {example!r}")
    folder = Path(text).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise DataError(f"output prefix {text!r}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DataError(f"output prefix {text!r}: cannot write in {folder} (permission denied)")


def check_output_free(prefix: str | os.PathLike, overwrite: bool) -> None:
    check_prefix(prefix)
    existing = [p for key, p in prefix_paths(prefix).items() if p.exists()]
    if existing and not overwrite:
        raise DataError(f"output {existing[0]} exists; refusing to overwrite it (pass --overwrite)")
    folders = [p for p in existing if p.is_dir()]
    if folders:
        raise DataError(f"output {folders[0]} is a directory; refusing to replace it")


def _make_parents(path: Path) -> list[Path]:
    """mkdir -p of `path`'s folder; returns the folders it created, deepest first."""
    created, folder = [], path.parent
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    return created


class IndexedDatasetWriter:
    """Collects documents (token ids, EOD included) into `PREFIX.bin/.idx` under temporary names;
    `commit()` makes them visible, `abort()` (also on any exception in a `with` block, KeyboardInterrupt
    included) removes them. Files are created on entering the `with` block (or at the first document)."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, overwrite: bool = False):
        check_output_free(prefix, overwrite)
        self.final = prefix_paths(prefix)
        self.tmp = prefix_paths(temp_prefix(prefix))
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.documents = 0
        self.tokens = 0
        self.committed = False
        self._builder = None
        self._created: list[Path] = []
        self._done = False

    def _open(self) -> None:
        if self._builder is not None:
            return
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        try:
            self._created = _make_parents(self.final["bin"])
            self._builder = IndexedDatasetBuilder(str(self.tmp["bin"]), dtype=self.dtype)
        except OSError as err:
            self.abort()
            raise DataError(f"cannot write {self.tmp['bin']}: {err.strerror or err}") from None
        except BaseException:
            self.abort()  # interrupted between creating the .bin and holding it
            raise

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        self._open()
        ids = np.asarray(ids)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"token id {int(ids.max())} is outside the tokenizer's vocabulary ({self.vocab_size})")
        self._builder.add_document(ids, [ids.size])
        self.documents += 1
        self.tokens += int(ids.size)

    def commit(self, meta: dict[str, Any], tokenizer_file: Optional[Path] = None) -> dict[str, Any]:
        """Make the prefix visible. `tokenizer_file` (best written to `self.tmp["tokenizer"]`) becomes
        `PREFIX.tokenizer.model`; without one, the tokenizer file of an overwritten earlier run is removed,
        so that the prefix's files are exactly this run's."""
        self._open()
        self._builder.finalize(str(self.tmp["idx"]))
        for key in ("bin", "idx"):
            _fsync(self.tmp[key])
        meta = {
            **meta,
            "format": "megatron-core IndexedDataset",
            "dtype": np.dtype(self.dtype).name,
            "documents": self.documents,
            "tokens": self.tokens,
            "bin_bytes": self.tmp["bin"].stat().st_size,
            "idx_sha256": _sha256(self.tmp["idx"]),
        }
        if tokenizer_file is not None:
            if Path(tokenizer_file) != self.tmp["tokenizer"]:
                os.replace(tokenizer_file, self.tmp["tokenizer"])
            _fsync(self.tmp["tokenizer"])
            meta["tokenizer_file"] = self.final["tokenizer"].name
        self.tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        _fsync(self.tmp["meta"])
        # Everything new is complete on disk; only now is the old prefix touched. Its .idx goes first and
        # the new one comes last, so no moment shows an .idx beside another run's files; and a Ctrl-C
        # waits for the few renames in between.
        with signals_deferred():
            self.final["idx"].unlink(missing_ok=True)
            if tokenizer_file is not None:
                os.replace(self.tmp["tokenizer"], self.final["tokenizer"])
            else:
                self.final["tokenizer"].unlink(missing_ok=True)
            for key in ("bin", "meta", "idx"):
                os.replace(self.tmp[key], self.final[key])
            self._done = self.committed = True
        fsync_dir(self.final["idx"].parent, strict=False)
        return meta

    def abort(self) -> None:
        if self._done:
            return
        with signals_deferred():  # a second Ctrl-C does not cut the cleanup short
            if self._builder is not None:
                try:
                    self._builder.data_file.close()
                except Exception:
                    pass
            for path in self.tmp.values():
                path.unlink(missing_ok=True)
            for folder in self._created:  # folders this writer made, if nothing else was put there
                try:
                    folder.rmdir()
                except OSError:
                    break
            self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        self._open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()  # a no-op after commit


def read_meta(prefix: str | os.PathLike) -> Optional[dict[str, Any]]:
    path = prefix_paths(prefix)["meta"]
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg})") from None


def verify_prefix(prefix: str | os.PathLike, tokenizer_identity: Optional[str] = None) -> Optional[dict]:
    """Refuse a prefix that training would mis-read: missing files, a truncated `.bin`, an `.idx` that
    does not describe its `.bin`, or data tokenized with another tokenizer. Returns the manifest (None
    for a prefix made by other tools, which is checked for consistency only)."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    paths = prefix_paths(prefix)
    for key in ("idx", "bin"):
        if not paths[key].is_file():
            hint = " (an interrupted grt-prepare-data leaves no .idx)" if key == "idx" else ""
            raise DataError(f"data prefix {str(prefix)!r}: {paths[key]} not found{hint}")
    try:
        index = _IndexReader(str(paths["idx"]), multimodal=False)
        expected = int(np.asarray(index.sequence_lengths, dtype=np.int64).sum()) * np.dtype(index.dtype).itemsize
    except Exception as err:
        raise DataError(f"{paths['idx']}: not a valid Megatron index ({type(err).__name__}: {err})") from None
    actual = paths["bin"].stat().st_size
    if actual != expected:
        raise DataError(f"{paths['bin']} has {actual} bytes but {paths['idx']} describes {expected}: "
                        "the .bin is truncated or the pair does not match")
    meta = read_meta(prefix)
    if meta is not None:
        if meta.get("idx_sha256") != _sha256(paths["idx"]):
            raise DataError(f"{paths['idx']} does not match its manifest {paths['meta']} (sha256 differs)")
        if meta.get("bin_bytes") != actual:
            raise DataError(f"{paths['bin']} has {actual} bytes, its manifest {paths['meta']} says "
                            f"{meta.get('bin_bytes')}")
        if tokenizer_identity is not None and meta.get("tokenizer", {}).get("sha256") != tokenizer_identity:
            raise DataError(f"data prefix {str(prefix)!r} was tokenized with another tokenizer "
                            f"({meta.get('tokenizer', {}).get('source')}) than the one configured")
    elif tokenizer_identity is not None:
        # No manifest (another tool's prefix, or one whose .meta.json was lost): a sentencepiece model beside
        # it (grt-prepare-data writes PREFIX.tokenizer.model) still tells which tokenizer made it.
        if paths["tokenizer"].is_file():
            if _sha256(paths["tokenizer"]) != tokenizer_identity:
                raise DataError(f"data prefix {str(prefix)!r} was tokenized with {paths['tokenizer']}, not the "
                                "tokenizer configured")
        elif int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: data prefix {str(prefix)!r} has no {META_SUFFIX} nor {TOKENIZER_SUFFIX}: nothing "
                  "shows which tokenizer made it, so it cannot be checked against the configured one", flush=True)
    return meta
