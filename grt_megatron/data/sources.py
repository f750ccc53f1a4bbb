"""Where text comes from: the built-in corpus, local .txt/.jsonl/.parquet files, local directories of them,
Hugging Face datasets.

A source is, in this order: `builtin:pydoc_topics`; `synthetic:NAME[:options]` (a generated task,
data/synthetic.py); an existing file (`.jsonl`/`.json`: one JSON record a
line; `.parquet`; anything else: plain text); an existing directory, read as every `.txt`, `.jsonl`,
`.json` and `.parquet` file under it, recursively, in sorted path order (folder by folder), each as that
file alone would be read, other files ignored; otherwise a Hugging Face dataset `name[:config][@split]`
(a name that looks like a path or a file is refused as missing instead).

Bad records and bad bytes either stop the run with one line naming the file and line, or are skipped /
replaced and counted, as the caller's `SourcePolicy` says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

BUILTIN_PYDOC = "builtin:pydoc_topics"
SYNTHETIC = "synthetic:"
"""`synthetic:NAME[:options]`: a generated depth-probe task (data/synthetic.py)."""
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
TXT_DOCUMENT_CHARS = 8192
"""Plain text files are cut into documents of about this many characters at paragraph breaks, so that
document-level train/valid/test splits work on a single file (joined by blank lines they give back the
file, with runs of blank lines normalised to one)."""


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, line or field."""


class EmptyCorpusError(DataError):
    """The inputs hold no non-blank document."""


@dataclass
class SourcePolicy:
    text_key: str = "text"
    on_bad_record: str = "fail"
    """A jsonl line that is not JSON or lacks the text key, or a text value that is not a string (jsonl,
    parquet, datasets): `fail` or `skip` (counted)."""
    on_decode_error: str = "fail"
    """Bytes that are not UTF-8: `fail` or `replace` with U+FFFD (counted)."""

    def __post_init__(self) -> None:
        if self.on_bad_record not in ("fail", "skip"):
            raise DataError(f"on_bad_record={self.on_bad_record!r} is not one of fail, skip")
        if self.on_decode_error not in ("fail", "replace"):
            raise DataError(f"on_decode_error={self.on_decode_error!r} is not one of fail, replace")


@dataclass
class SourceStats:
    documents: int = 0
    skipped_records: int = 0
    replaced_decode_errors: int = 0


def _decode(raw: bytes, where: str, policy: SourcePolicy, stats: SourceStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if policy.on_decode_error == "fail":
            raise DataError(f"{where}: not UTF-8 (byte {err.start}); use on_decode_error=replace "
                            "to replace bad bytes") from None
        stats.replaced_decode_errors += 1
        return raw.decode("utf-8", errors="replace")


def split_text_file(text: str, target_chars: int = TXT_DOCUMENT_CHARS) -> Iterator[str]:
    """Whole paragraphs grouped into documents of at least `target_chars` (the last may be shorter)."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text)]
    doc: list[str] = []
    size = 0
    for para in paragraphs:
        if not para.strip():
            continue
        doc.append(para)
        size += len(para)
        if size >= target_chars:
            yield "\n\n".join(doc)
            doc, size = [], 0
    if doc:
        yield "\n\n".join(doc)


def _pydoc_topics() -> Iterator[str]:
    # The Python language reference, shipped with every CPython: real English prose and code, offline.
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _bad_record(where: str, problem: str, policy: SourcePolicy, stats: SourceStats) -> None:
    """A record that cannot be a document: refused naming it (`fail`), or skipped and counted (`skip`)."""
    if policy.on_bad_record == "fail":
        raise DataError(f"{where}: {problem}; use on_bad_record=skip to skip such records")
    stats.skipped_records += 1


def _text_or_none(value, where: str, policy: SourcePolicy, stats: SourceStats) -> Optional[str]:
    """A record's text value, if it is a string: a null or a number would otherwise become the document
    "None" or "5" in silence."""
    if isinstance(value, str):
        return value
    kind = "null" if value is None else type(value).__name__
    _bad_record(where, f"{policy.text_key!r} is {kind}, not a string", policy, stats)
    return None


def _jsonl(path: Path, policy: SourcePolicy, stats: SourceStats) -> Iterator[str]:
    try:
        f = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            line = _decode(raw, where, policy, stats)
            try:
                record = json.loads(line)
                problem = None if isinstance(record, dict) and policy.text_key in record else (
                    f"no {policy.text_key!r} key")
            except json.JSONDecodeError as err:
                problem = f"not valid JSON ({err.msg})"
            if problem is not None:
                _bad_record(where, problem, policy, stats)
                continue
            text = _text_or_none(record[policy.text_key], where, policy, stats)
            if text is not None:
                yield text


def _parquet(path: Path, policy: SourcePolicy, stats: SourceStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:
        raise DataError(f"{path}: not a parquet file ({type(err).__name__})") from None
    if policy.text_key not in table.schema_arrow.names:
        raise DataError(f"{path}: no column {policy.text_key!r} (columns: {table.schema_arrow.names})")
    row = 0
    for batch in table.iter_batches(columns=[policy.text_key], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            text = _text_or_none(value, f"{path}: row {row}", policy, stats)
            if text is not None:
                yield text


def _hf_dataset(spec: str, policy: SourcePolicy, stats: SourceStats) -> Iterator[str]:
    """`name[:config][@split]`, e.g. `wikitext:wikitext-2-raw-v1@train`, streamed."""
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        first = next(iter(ds.take(1)), None)
    except Exception as err:  # offline, unknown name, ...: one line, not a stack trace
        raise DataError(f"input {spec!r}: not a local file, and loading it as a Hugging Face dataset failed: "
                        f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}") from None
    if first is not None and policy.text_key not in first:
        raise DataError(f"dataset {spec!r} has no column {policy.text_key!r} (columns: {sorted(first)})")
    for row, record in enumerate(ds, 1):
        text = _text_or_none(record[policy.text_key], f"dataset {spec!r}: row {row}", policy, stats)
        if text is not None:
            yield text


def _local_file(path: Path, policy: SourcePolicy, stats: SourceStats) -> Iterator[str]:
    if path.suffix in (".jsonl", ".json"):
        yield from _jsonl(path, policy, stats)
    elif path.suffix == ".parquet":
        yield from _parquet(path, policy, stats)
    else:  # any other file is plain text
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
        yield from split_text_file(_decode(raw, str(path), policy, stats))


def directory_files(path: Path) -> list[Path]:
    """The files a directory source reads: every LOCAL_SUFFIXES file under `path`, recursively, sorted by
    path component by component (a folder's files stay together, before the next folder's)."""
    try:
        return sorted(p for p in Path(path).rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
    except OSError as err:
        raise DataError(f"input {str(path)!r}: cannot list the directory ({err.strerror or err})") from None


def _local_files(source: str) -> list[Path] | None:
    """The files a local source reads (None: not local, a dataset name or the built-in corpus); a path
    that is not there, or a directory with nothing to read, is refused."""
    if source in (BUILTIN_PYDOC, "builtin") or source.startswith(SYNTHETIC):
        return None
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():  # before the dataset name: a local folder wins over a hub name
        files = directory_files(path)
        if not files:
            raise DataError(f"input {source!r}: a directory without any {', '.join('*' + s for s in LOCAL_SUFFIXES)} "
                            "file (searched recursively)")
        return files
    if path.suffix in LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
        raise DataError(f"input {source!r}: no such file")
    return None


def check_sources(sources: Sequence[str] | str) -> None:
    """Refuse a missing local input or an empty directory now, before hours are spent on the inputs
    before it (the contents are checked as they are read)."""
    for source in [sources] if isinstance(sources, str) else sources:
        if source.startswith(SYNTHETIC):
            from grt_megatron.data.synthetic import parse_synthetic

            parse_synthetic(source)
        _local_files(source)


def _one_source(source: str, policy: SourcePolicy, stats: SourceStats) -> Iterator[str]:
    if source in (BUILTIN_PYDOC, "builtin"):
        yield from _pydoc_topics()
        return
    if source.startswith(SYNTHETIC):
        from grt_megatron.data.synthetic import parse_synthetic

        yield from parse_synthetic(source).documents()
        return
    files = _local_files(source)
    if files is None:
        yield from _hf_dataset(source, policy, stats)
        return
    for file in files:
        yield from _local_file(file, policy, stats)


def iter_documents(sources: Sequence[str] | str, policy: SourcePolicy | None = None,
                   stats: SourceStats | None = None) -> Iterator[str]:
    """Non-empty documents of every source in order; `stats` counts documents, skips, replacements."""
    policy = policy or SourcePolicy()
    stats = stats if stats is not None else SourceStats()
    for source in [sources] if isinstance(sources, str) else sources:
        for doc in _one_source(source, policy, stats):
            if doc.strip():
                stats.documents += 1
                yield doc


def load_documents(sources: Sequence[str] | str, policy: SourcePolicy | None = None) -> list[str]:
    docs = list(iter_documents(sources, policy))
    if not docs:
        raise EmptyCorpusError(f"input {sources!r}: the corpus is empty")
    return docs
