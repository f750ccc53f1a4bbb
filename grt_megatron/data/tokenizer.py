"""One tokenizer interface for data preparation, training and sampling: sentencepiece (BPE, byte fallback).

Newlines are a piece of their own and whitespace is kept as is, so decoded samples keep their layout.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from grt_megatron.data.corpus import DataError


class Tokenizer:
    def __init__(self, model_proto: bytes, source: str = "<memory>"):
        self.model_proto = model_proto
        self.source = source
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise DataError(f"data.tokenizer={str(path)!r}: no such file")
        proto = path.read_bytes()
        try:
            return cls(proto, str(path))
        except RuntimeError:
            raise DataError(f"{path}: not a sentencepiece model") from None

    @classmethod
    def train(cls, documents: Iterable[str], vocab_size: int) -> "Tokenizer":
        def paragraphs():
            for doc in documents:
                for para in doc.split("\n\n"):
                    if para.strip():
                        yield para

        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=paragraphs(), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
                byte_fallback=True, character_coverage=0.9995, user_defined_symbols=["\n"],
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=1 << 16,
                input_sentence_size=1_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
                unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2,
            )
        except RuntimeError as err:
            raise DataError(f"data.vocab_size={vocab_size}: sentencepiece could not train: {err}") from None
        return cls(buf.getvalue(), "trained")

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(self.model_proto)
        os.replace(tmp, path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def identity(self) -> str:
        """sha256 of the model file: what a checkpoint records to refuse a different tokenizer."""
        return hashlib.sha256(self.model_proto).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_documents(self, documents: list[str]) -> list[list[int]]:
        return self._sp.encode(documents)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])
