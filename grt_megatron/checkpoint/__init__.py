"""Checkpoints: atomic, verified, safe to load (JSON + safetensors only), loadable into any layout."""

from grt_megatron.checkpoint.checkpointer import load_checkpoint, save_checkpoint
from grt_megatron.checkpoint.compat import compare_configs
from grt_megatron.checkpoint.state import CheckpointError
from grt_megatron.checkpoint.store import (
    CheckpointInfo,
    inspect_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    supersede_newer,
)

__all__ = [
    "CheckpointError", "CheckpointInfo", "compare_configs", "inspect_checkpoint", "list_checkpoints",
    "load_checkpoint", "resolve_checkpoint", "save_checkpoint", "supersede_newer",
]
