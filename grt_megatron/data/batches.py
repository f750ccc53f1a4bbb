"""Token streams and deterministic batches.

The batch of iteration i is a pure function of (seed, i): a resumed run continues the same data order,
and every data-parallel layout sees the same global batch (each rank takes its own rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grt_megatron.data.corpus import DataError, load_documents
from grt_megatron.data.tokenizer import Tokenizer

_STREAM = 0x6461  # separates data draws from the depth sampler's (seed, iteration) stream
_NOISE_STREAM = 0x6e6f


def tokens_from_documents(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """One stream: each document's ids followed by EOS."""
    ids = tokenizer.encode_documents(documents)
    total = sum(len(x) + 1 for x in ids)
    out = np.empty(total, dtype=np.int32)
    pos = 0
    for doc in ids:
        out[pos : pos + len(doc)] = doc
        out[pos + len(doc)] = tokenizer.eos_id
        pos += len(doc) + 1
    return out


@dataclass
class TokenSplits:
    train: np.ndarray
    valid: np.ndarray

    @classmethod
    def from_stream(cls, tokens: np.ndarray, valid_fraction: float, seq_length: int) -> "TokenSplits":
        n_valid = max(int(len(tokens) * valid_fraction), seq_length + 1)
        if len(tokens) - n_valid < 2 * (seq_length + 1):
            raise DataError(f"the corpus has {len(tokens)} tokens: too few for train.seq_length={seq_length} "
                            f"with data.valid_fraction={valid_fraction}")
        return cls(train=tokens[:-n_valid], valid=tokens[-n_valid:])


def load_token_splits(source: str, text_key: str, tokenizer: Tokenizer, valid_fraction: float,
                      seq_length: int) -> TokenSplits:
    stream = tokens_from_documents(tokenizer, load_documents(source, text_key))
    return TokenSplits.from_stream(stream, valid_fraction, seq_length)


def train_batch(tokens: np.ndarray, seq_length: int, seed: int, iteration: int, size: int) -> np.ndarray:
    """The global batch of `iteration`: `size` windows of seq_length + 1 tokens at random offsets."""
    rng = np.random.default_rng([seed, iteration, _STREAM])
    starts = rng.integers(0, len(tokens) - seq_length - 1, size=size)
    return np.stack([tokens[s : s + seq_length + 1] for s in starts]).astype(np.int64)


def eval_windows(tokens: np.ndarray, seq_length: int, max_windows: int) -> np.ndarray:
    """Fixed, non-overlapping windows [n, seq_length + 1] from the start of the validation stream:
    the same set at every evaluation and in every parallel layout."""
    count = min((len(tokens) - 1) // seq_length, max_windows)
    return np.stack([tokens[i * seq_length : i * seq_length + seq_length + 1] for i in range(count)]).astype(np.int64)


def sample_noise_seeds(seed: int, iteration: int, rows: range) -> list[int]:
    """One seed per global batch row: the model's training noise for a sample depends on
    (seed, iteration, row) only, not on the data-parallel rank or micro-batch that runs it."""
    return [int(np.random.SeedSequence([seed, iteration, row, _NOISE_STREAM]).generate_state(1)[0])
            for row in rows]
