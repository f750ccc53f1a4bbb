"""grt-megatron: a pretraining framework for Gated Recurrent Transformers on megatron-core and DeepSpeed."""

__version__ = "0.1.0"
