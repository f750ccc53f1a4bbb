"""Text → tokenizer → Megatron indexed datasets → blended GPT datasets.

Kept import-light (no torch/megatron at import) so tokenizer worker processes start fast.
"""

from grt_megatron.data.sources import DataError, SourcePolicy, iter_documents, load_documents
from grt_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = ["DataError", "HFTokenizer", "SentencePieceTokenizer", "SourcePolicy", "Tokenizer", "iter_documents",
           "load_documents", "load_tokenizer"]
