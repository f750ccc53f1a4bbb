"""One fp32 state dict from a checkpoint of any layout (TP shards merged, pipeline stages joined), and the
way back: a weights-only step-0 checkpoint from one (`grt-convert-hf --from-hf`, `grt-ckpt relax`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as save_tensors
from tqdm import tqdm

from grt_megatron.checkpoint.checkpointer import ShardIndex
from grt_megatron.checkpoint.state import MOMENTS, VOCAB_TENSORS, fit_vocab_rows
from grt_megatron.checkpoint.store import CheckpointError, inspect_checkpoint
from grt_megatron.model import GRTConfig


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """`consolidate`'s tensors into a one-process model, every parameter required. Transformer Engine's layers
    (the GPU's `auto` spec) also list an `_extra_state` entry (FP8 metadata) that checkpoints do not hold,
    since they save parameters only: those alone may be missing."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint and model disagree: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")


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


def write_weights_checkpoint(output: Path, plain: dict, model: dict, tokenizer, reason: str,
                             progress: bool = True) -> Path:
    """A training checkpoint holding `plain` (a one-process state dict of the `model` recipe) and the tokenizer,
    with no optimizer state, written atomically at `output` (`.../step_NNNNNNNN`): `grt-train resume=` starts
    from it in any layout."""
    from grt_megatron import __version__
    from grt_megatron.checkpoint.store import TRAINER_STATE, PendingSave, write_file

    output = Path(output)
    if output.exists():
        raise CheckpointError(f"--output {output} exists; refusing to overwrite it")
    if not output.name.startswith("step_") or not output.name[5:].isdigit():
        raise CheckpointError(f"--output {output}: name a checkpoint directory step_NNNNNNNN (e.g. step_00000000)")
    config = GRTConfig.from_recipe(model)
    pending = PendingSave(output.parent, int(output.name[5:]))
    pending.prepare()
    tensors = {f"param/{k}": v.float().contiguous() for k, v in tqdm(sorted(plain.items()), desc="write",
                                                                      unit="tensor", disable=not progress)}
    files = {"model-tp00-pp00.safetensors": write_file(
        pending.tmp / "model-tp00-pp00.safetensors",
        save_tensors(tensors, metadata={"tp_rank": "0", "pp_rank": "0", "partition_dims": json.dumps({})}))}
    files.update(pending.add_tokenizer(tokenizer))
    state = {"version": __version__, "step": int(output.name[5:]), "consumed_samples": 0, "tokens": 0,
             "train_samples": None, "seq_length": model["max_sequence_length"],
             "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "sp": False, "zero_stage": 0,
                        "precision": "fp32"},
             "config": None, "model": model, "model_shape": config.shape_name,
             "tokenizer": tokenizer.describe(), "data_prefixes": [], "reason": reason,
             "saved_at": "", "optimizer_steps": 0,
             "lr_scheduler": {"last_epoch": 0, "_step_count": 1}}
    files[TRAINER_STATE] = write_file(pending.tmp / TRAINER_STATE, json.dumps(state, indent=2).encode())
    return pending.commit(files, permanent=False)


def relax_checkpoint(dense_checkpoint: Path, output: Path, shape: str, lora_rank: int,
                     progress: bool = True) -> Path:
    """A dense checkpoint -> an RRT checkpoint of shape `P+KxR+C` at step 0 (`grt-ckpt relax`): the tied layers'
    mean as the shared core, the truncated SVD of each layer's difference as its recursion's LoRA
    (`model.relaxed.relax_dense_state`). The RRT recipe is the dense one with that shape, a plain recursion
    (no gate, re-injection or noise, fixed depth) and `lora_rank`."""
    import re

    from grt_megatron.data.tokenizer import load_tokenizer
    from grt_megatron.model.relaxed import relax_dense_state

    match = re.fullmatch(r"(\d+)\+(\d+)x(\d+)\+(\d+)", shape)
    if not match:
        raise CheckpointError(f"--shape {shape!r}: write it P+KxR+C, e.g. 1+1x4+1")
    p, k, r, c = map(int, match.groups())
    if lora_rank < 1:
        raise CheckpointError(f"--lora-rank {lora_rank}: must be >= 1")
    from grt_megatron.checkpoint.store import checkpoint_dir

    dense_checkpoint, _ = checkpoint_dir(str(dense_checkpoint))  # a run directory: its newest complete checkpoint
    plain, _ = consolidate(dense_checkpoint, progress=progress)
    info = inspect_checkpoint(dense_checkpoint)
    dense = dict(info.state["model"])
    if not GRTConfig.from_recipe(dense).is_dense:
        raise CheckpointError(f"{dense_checkpoint}: model {info.state['model_shape']} is not dense "
                              "(relax initialises an RRT from a dense model)")
    depth = dense["prelude_layers"] + dense["core_layers"] + dense["coda_layers"]
    if p + k * r + c != depth:
        raise CheckpointError(f"--shape {shape}: {p}+{k}x{r}+{c} executes {p + k * r + c} layers; the dense model "
                              f"has {depth}")
    model = {**dense, "prelude_layers": p, "core_layers": k, "recurrences": r, "coda_layers": c, "gate": "none",
             "injection": "none", "noise_sigma": 0.0, "depth_sampler": "fixed", "lora_rank": lora_rank}
    model = GRTConfig.from_recipe(model).to_dict()
    relaxed = relax_dense_state(plain, prelude=p, core=k, recurrences=r, coda=c, rank=lora_rank)
    tokenizer = load_tokenizer(next(q for q in (info.path / "tokenizer.model", info.path / "tokenizer") if q.exists()))
    return write_weights_checkpoint(output, relaxed, model, tokenizer, progress=progress,
                                    reason=f"relaxed from {info.path} ({shape}, LoRA rank {lora_rank})")
