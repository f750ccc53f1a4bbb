"""What may change when a run resumes: a saved configuration against the new one."""

from __future__ import annotations

import dataclasses
from typing import Any

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.kernels import KERNEL_FIELDS

# Changes a run cannot continue through, with why. Everything else (steps, LR schedule, logging,
# intervals, layout: TP/PP/DP/ZeRO, precision, micro-batch size) is applied and listed.
REFUSED = {
    "model": "the model's shape and math",
    "seed": "weights' noise, depth draws and the data order are keyed by the seed",
    "train.seq_length": "the sequence length fixes the data's samples and positions",
    "train.global_batch_size": "the data position is step × global batch size",
    "train.optimizer": "the optimizer's state is AdamW's; another implementation would not continue it",
    "data.source": "the data", "data.prefixes": "the data", "data.weights": "the data order",
    "data.split": "the data order", "data.tokenizer": "the tokenizer",
}
IGNORED = ("resume", "run.dir")
# Model fields that change memory, speed, precision or evaluation, not the training math (the kernel choices
# compute the same function within rounding, with the same parameter names: model/kernels.py; an fp32 residual
# stream rounds less, as a change of train.precision does).
MODEL_ALLOWED = ("checkpoint_recurrence", "mor_eval_routing", "exit_threshold", "fp32_residual_connection",
                 *KERNEL_FIELDS)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _reason(key: str) -> str | None:
    for refused, why in REFUSED.items():
        if key == refused or key.startswith(refused + "."):
            return why
    return None


def compare_configs(saved: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused changes, applied changes), one line each: `key: old -> new (why)`."""
    before, after = _flatten(saved), _flatten(new)
    refused, applied = [], []
    for key in sorted(set(before) | set(after)):
        if key in IGNORED or key.startswith("data.train_samples"):
            continue
        old, now = before.get(key, "<unset>"), after.get(key, "<unset>")
        if old == now:
            continue
        why = _reason(key)
        line = f"{key}: {old!r} -> {now!r}"
        (refused if why else applied).append(f"{line} ({why})" if why else line)
    return refused, applied


# Model fields added after checkpoints were first written: a checkpoint without them ran with what is
# now their default (the default is the old behaviour), read from GRTConfig so the two cannot drift.
MODEL_FIELDS_ADDED_LATER = ("routing", "router_aux_loss_coeff", "fp32_residual_connection")
MODEL_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRTConfig) if f.name in MODEL_FIELDS_ADDED_LATER}
MODEL_FIELD_DEFAULTS.update(dict.fromkeys(KERNEL_FIELDS, "auto"))  # absent before; may change anyway


def compare_models(saved: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The effective model fields (`GRTConfig.to_dict()`, vocabulary resolved), as `compare_configs`."""
    refused, applied = [], []
    saved = {**MODEL_FIELD_DEFAULTS, **saved}
    for key in sorted(set(saved) | set(new)):
        old, now = saved.get(key, "<unset>"), new.get(key, "<unset>")
        if old != now:
            line = f"model.{key}: {old!r} -> {now!r}"
            (applied if key in MODEL_ALLOWED else refused).append(line if key in MODEL_ALLOWED
                                                                   else f"{line} ({REFUSED['model']})")
    return refused, applied
