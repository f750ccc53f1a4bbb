"""One tokenizer interface for data preparation, training, sampling and export.

Two kinds behind it: a sentencepiece model (trained here on a sample of the corpus — BPE or unigram, byte
fallback, newlines and whitespace kept — or loaded from a `.model` file) and a Hugging Face tokenizer
(a local folder, or a hub name where the network allows). `load_tokenizer(spec)` picks by what `spec` is.
"""

from __future__ import annotations

import hashlib
import io
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from grt_megatron.data.sources import DataError, EmptyCorpusError
from grt_megatron.files import write_atomic

TRAIN_SAMPLE_BYTES = 200_000_000
"""The tokenizer is trained on at most this much text from the start of the corpus."""


class Tokenizer(ABC):
    source: str
    file_name: str
    """What `save` writes by default (a run dir keeps its tokenizer under this name)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abstractmethod
    def identity(self) -> str:
        """A sha256 that changes whenever the token ↔ id mapping could: checkpoints and datasets
        record it so that a different tokenizer is refused instead of silently mis-reading ids."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abstractmethod
    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer so that `load_tokenizer(returned path)` gives it back."""

    def token_texts(self) -> list[str]:
        """Each id's text decoded alone (spaces a tokenizer attaches to a piece may be dropped): what lets a
        rule written for text find its tokens in a row of ids (the answer-token loss mask, synthetic.py)."""
        return [self.decode([i]) for i in range(self.vocab_size)]

    def describe(self) -> dict:
        return {"kind": type(self).__name__, "source": self.source, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "sha256": self.identity}


class SentencePieceTokenizer(Tokenizer):
    file_name = "tokenizer.model"

    def __init__(self, model_proto: bytes, source: str = "<memory>"):
        import sentencepiece as spm

        self.model_proto = model_proto
        self.source = source
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    def __getstate__(self) -> dict:  # picklable for tokenizer worker processes
        return {"model_proto": self.model_proto, "source": self.source}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"], state["source"])

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        path = Path(path)
        try:
            tokenizer = cls(path.read_bytes(), str(path))
        except (RuntimeError, OSError):
            raise DataError(f"{path}: not a sentencepiece model") from None
        if tokenizer.vocab_size == 0:  # sentencepiece loads an empty file as a model of no pieces
            raise DataError(f"{path}: not a sentencepiece model (no pieces; an empty file?)")
        return tokenizer

    @classmethod
    def train(cls, documents: Iterable[str], vocab_size: int, model_type: str = "bpe",
              max_bytes: int = TRAIN_SAMPLE_BYTES) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        if model_type not in ("bpe", "unigram"):
            raise DataError(f"tokenizer model type {model_type!r} is not one of bpe, unigram")

        # sentencepiece does not let an exception raised inside its sentence iterator through: depending on
        # the version it trains on what it got so far, or reports "no sentences" or its own "INTERNAL:
        # KeyboardInterrupt" error. A bad input file or a Ctrl-C (KeyboardInterrupt, or what a SIGTERM
        # handler raises) would become a tokenizer of a cut sample or a misleading error. So the iterator
        # keeps the first exception and hands sentencepiece a non-string, which stops it at once; the kept
        # exception is raised here. (A signal while sentencepiece trains, after the last sentence, is
        # raised by Python when it returns.)
        failure: list[BaseException] = []
        seen = [0]

        def paragraphs():
            try:
                for doc in documents:
                    for para in doc.split("\n\n"):
                        if para.strip():
                            seen[0] += len(para)
                            yield para
                    if seen[0] >= max_bytes:
                        return
            except GeneratorExit:  # sentencepiece let go of the iterator: not a failure
                raise
            except BaseException as err:
                failure.append(err)
                yield None  # not a str: sentencepiece stops with an error

        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=paragraphs(), model_writer=buf, vocab_size=vocab_size, model_type=model_type,
                byte_fallback=True, character_coverage=0.9995, user_defined_symbols=["\n"],
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=1 << 16,
                input_sentence_size=1_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
                unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2,
            )
        except Exception as err:
            if failure:
                raise failure[0] from None
            if not isinstance(err, RuntimeError):
                raise
            if seen[0] == 0:
                raise EmptyCorpusError("no text to train a tokenizer on: the corpus is empty") from None
            raise DataError(f"vocab size {vocab_size}: sentencepiece could not train: {err}") from None
        if failure:
            raise failure[0]
        return cls(buf.getvalue(), f"trained {model_type} {vocab_size}")

    def save(self, path: str | os.PathLike) -> Path:
        return write_atomic(path, self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def identity(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_texts(self) -> list[str]:
        # From the pieces, not decode([id]): decoding one piece drops the space "▁" stands for, and the
        # answer-token mask must count a lone "▁" before an answer's digit as the probe does.
        sp = self._sp
        out = []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i):
                out.append("")
            elif sp.is_byte(i):  # "<0x41>": ASCII as itself; a byte of a longer UTF-8 character has no text alone
                byte = int(piece[3:-1], 16)
                out.append(chr(byte) if byte < 128 else "\ufffd")
            else:
                out.append(piece.replace("\u2581", " "))
        return out


class HFTokenizer(Tokenizer):
    """A `transformers` tokenizer (e.g. GPT-2's BPE); EOS is its `eos_token`."""

    file_name = "tokenizer"

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as err:  # offline, unknown name, broken folder: one line
            raise DataError(f"tokenizer {name_or_path!r} could not be loaded: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from None
        if self._tok.eos_token_id is None:
            raise DataError(f"tokenizer {name_or_path!r} has no EOS token; documents need one as separator")
        self.source = name_or_path

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def identity(self) -> str:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            text = backend.to_str()
        else:
            text = repr(sorted(self._tok.get_vocab().items()))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save_pretrained(str(path))
        return path


def check_tokenizer_file(spec: str | os.PathLike) -> None:
    """Refuse a tokenizer that names a local file (a `.model`, or a path) that is not there; anything else
    that does not exist here is a Hugging Face hub name."""
    if not Path(spec).expanduser().exists() and (str(spec).endswith(".model") or str(spec).startswith((".", "/", "~"))):
        raise DataError(f"tokenizer {str(spec)!r}: no such file")


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """A sentencepiece `.model` file, a Hugging Face tokenizer folder, or a hub name."""
    path = Path(spec).expanduser()
    if path.is_file():
        return SentencePieceTokenizer.load(path)
    if path.is_dir():
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise DataError(f"{path}: a folder without tokenizer.json/tokenizer_config.json")
        return HFTokenizer(str(path))
    check_tokenizer_file(spec)
    return HFTokenizer(str(spec))


class MegatronTokenizerView:
    """What megatron-core's GPTDataset asks of a tokenizer (eod, vocab size, a cache identity)."""

    def __init__(self, tokenizer: Tokenizer):
        self.eod = tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size
        self.unique_identifiers = OrderedDict(kind=type(tokenizer).__name__, sha256=tokenizer.identity)
