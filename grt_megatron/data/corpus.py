"""Where training text comes from: the built-in corpus, a local file, or a Hugging Face dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

BUILTIN_PYDOC = "builtin:pydoc_topics"


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, line or field."""


def _pydoc_topics() -> Iterator[str]:
    # The Python language reference, shipped with every CPython: real English prose and code, offline.
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _jsonl(path: Path, text_key: str) -> Iterator[str]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_key not in record:
                raise DataError(f"{path}:{lineno}: no {text_key!r} key (set data.text_key)")
            yield str(record[text_key])


def _hf_dataset(spec: str, text_key: str) -> Iterator[str]:
    """`name[:config][@split]`, e.g. `wikitext:wikitext-2-raw-v1@train`."""
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as err:  # offline, unknown name, ...: one line, not a stack trace
        raise DataError(f"data.source={spec!r}: not a local file, and loading it as a Hugging Face "
                        f"dataset failed: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    if text_key not in ds.column_names:
        raise DataError(f"dataset {spec!r} has no column {text_key!r} (columns: {ds.column_names})")
    yield from ds[text_key]


def iter_documents(source: str, text_key: str = "text") -> Iterator[str]:
    if source in (BUILTIN_PYDOC, "builtin"):
        yield from _pydoc_topics()
        return
    path = Path(source).expanduser()
    looks_local = path.suffix in (".txt", ".jsonl", ".json") or source.startswith((".", "/", "~"))
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            yield from _jsonl(path, text_key)
        else:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}: not UTF-8 text (byte {err.start})") from None
    elif looks_local:
        raise DataError(f"data.source={source!r}: no such file")
    else:
        yield from _hf_dataset(source, text_key)


def load_documents(source: str, text_key: str = "text") -> list[str]:
    docs = [d for d in iter_documents(source, text_key) if d.strip()]
    if not docs:
        raise DataError(f"data.source={source!r}: the corpus is empty")
    return docs
