"""Hugging Face export and import. `configuration_grt.py`, `modeling_grt.py` and `tokenization_grt.py` are
copied verbatim next to exported weights (they import only torch, transformers and, for the tokenizer,
transformers' sentencepiece backend); `convert.py` maps checkpoints to and from them."""
