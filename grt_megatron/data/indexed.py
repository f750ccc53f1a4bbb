"""Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`) written atomically, with a manifest, and checked.

Files are written under temporary names and renamed when complete, in the order `.bin`, `.meta.json`,
`.idx`: an `.idx` exists only beside a complete `.bin` and its manifest, so an interrupted preparation
never leaves a prefix that training would accept. The `.bin/.idx` pair is megatron-core's own format
(`IndexedDatasetBuilder`), readable by Megatron-LM's `IndexedDataset`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from grt_megatron.data.sources import DataError

META_SUFFIX = ".meta.json"
TOKENIZER_SUFFIX = ".tokenizer.model"


def prefix_paths(prefix: str | os.PathLike) -> dict[str, Path]:
    prefix = str(prefix)
    return {"bin": Path(prefix + ".bin"), "idx": Path(prefix + ".idx"), "meta": Path(prefix + META_SUFFIX),
            "tokenizer": Path(prefix + TOKENIZER_SUFFIX)}


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


def check_output_free(prefix: str | os.PathLike, overwrite: bool) -> None:
    existing = [p for key, p in prefix_paths(prefix).items() if p.exists()]
    if existing and not overwrite:
        raise DataError(f"output {existing[0]} exists; refusing to overwrite it (pass --overwrite)")


class IndexedDatasetWriter:
    """Collects documents (token ids, EOD included) into `PREFIX.bin/.idx` under temporary names;
    `commit()` makes them visible, `abort()` (also on any exception in a `with` block) removes them."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, overwrite: bool = False):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        check_output_free(prefix, overwrite)
        self.final = prefix_paths(prefix)
        self.final["bin"].parent.mkdir(parents=True, exist_ok=True)
        tmp_prefix = f"{prefix}.tmp-{os.getpid()}"
        self.tmp = prefix_paths(tmp_prefix)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.documents = 0
        self.tokens = 0
        self._builder = IndexedDatasetBuilder(str(self.tmp["bin"]), dtype=self.dtype)
        self._done = False

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        ids = np.asarray(ids)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"token id {int(ids.max())} is outside the tokenizer's vocabulary ({self.vocab_size})")
        self._builder.add_document(ids, [ids.size])
        self.documents += 1
        self.tokens += int(ids.size)

    def commit(self, meta: dict[str, Any], tokenizer_file: Optional[Path] = None) -> dict[str, Any]:
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
            os.replace(tokenizer_file, self.final["tokenizer"])
            meta["tokenizer_file"] = self.final["tokenizer"].name
        self.tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        _fsync(self.tmp["meta"])
        # .idx last: its presence means the prefix is complete.
        for key in ("bin", "meta", "idx"):
            os.replace(self.tmp[key], self.final[key])
        self._done = True
        return meta

    def abort(self) -> None:
        if self._done:
            return
        try:
            self._builder.data_file.close()
        except Exception:
            pass
        for path in self.tmp.values():
            path.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
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
    return meta
