"""One fp32 state dict from a checkpoint of any layout (TP shards merged, pipeline stages joined)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from grt_megatron.checkpoint.checkpointer import ShardIndex
from grt_megatron.checkpoint.state import MOMENTS, VOCAB_TENSORS, fit_vocab_rows
from grt_megatron.checkpoint.store import CheckpointError, inspect_checkpoint
from grt_megatron.model import GRTConfig


def consolidate(checkpoint: Path, with_optimizer: bool = False, progress: bool = True) -> tuple[dict, dict]:
    """(state dict, metadata): whole fp32 tensors named as in a one-process `GRTLanguageModel`
    (vocabulary padding as for TP 1), optionally with Adam moments as `exp_avg/NAME`, `exp_avg_sq/NAME`."""
    info = inspect_checkpoint(checkpoint, verify_hashes=True)
    if not info.complete:
        raise CheckpointError(info.problem or f"{checkpoint}: incomplete")
    state = info.state
    recipe = dict(state["model"])
    rows = GRTConfig.from_recipe(recipe).padded_vocab_size
    index = ShardIndex(info.path, state)
    names = sorted({key.split("/", 1)[1] for key in index.where if key.startswith("param/")})
    out = {}
    for name in tqdm(names, desc="consolidate", unit="tensor", disable=not progress):
        for prefix in ("param", *(MOMENTS if with_optimizer else ())):
            full = index.full(f"{prefix}/{name}", index.dims.get(name, -1))
            if full is None:
                continue
            if name in VOCAB_TENSORS:
                full = fit_vocab_rows(full, rows)
            out[name if prefix == "param" else f"{prefix}/{name}"] = full.to(torch.float32).contiguous()
    meta = {"format": "grt-megatron-consolidated", "step": str(state["step"]), "model_shape": state["model_shape"],
            "model_recipe": json.dumps(recipe), "source": str(info.path)}
    return out, meta
