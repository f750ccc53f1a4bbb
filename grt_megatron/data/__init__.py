"""Text → tokenizer → token streams → deterministic batches."""

from grt_megatron.data.batches import (TokenSplits, eval_windows, load_token_splits, sample_noise_seeds,
                                       train_batch)
from grt_megatron.data.corpus import DataError, load_documents
from grt_megatron.data.tokenizer import Tokenizer

__all__ = ["DataError", "Tokenizer", "TokenSplits", "eval_windows", "load_documents", "load_token_splits",
           "sample_noise_seeds", "train_batch"]
