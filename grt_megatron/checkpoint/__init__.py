"""Checkpoints: atomic, verified, safe to load (JSON + safetensors only), loadable into any layout.

Names are imported on first use, so that `grt-ckpt ls` does not load torch, megatron and DeepSpeed.
"""

import importlib

_EXPORTS = {
    "save_checkpoint": "checkpointer", "load_checkpoint": "checkpointer",
    "compare_configs": "compat", "compare_models": "compat",
    "CheckpointError": "store", "CheckpointWriteError": "store", "CheckpointInfo": "store",
    "inspect_checkpoint": "store", "list_checkpoints": "store", "resolve_checkpoint": "store",
    "checkpoint_dir": "store", "supersede_newer": "store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
