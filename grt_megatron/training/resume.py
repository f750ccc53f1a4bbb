"""Whether a run can continue from a checkpoint with the settings it is resumed with."""

from __future__ import annotations

import json

from grt_megatron.checkpoint import compare_configs, compare_models
from grt_megatron.model import ConfigError
from grt_megatron.training.config import RunConfig
from grt_megatron.training.data import default_train_samples


def check_resume(saved: dict, cfg: RunConfig, model: dict, announce: bool) -> int:
    """Refuse changes a run cannot continue through (listing them); list those applied. `model` is the
    new effective model (`GRTConfig.to_dict()`). A checkpoint imported from Hugging Face has no run
    config: only its model must match. Returns the length of the training sample stream to rebuild."""
    refused, applied = compare_models(saved["model"], model)
    if saved.get("config") is None:
        return default_train_samples(cfg)
    before, after = json.loads(json.dumps(saved["config"])), cfg.to_dict()
    before["train"]["seq_length"], after["train"]["seq_length"] = saved["seq_length"], cfg.seq_length
    before.pop("model"), after.pop("model")  # compared above, as effective values
    run_refused, run_applied = compare_configs(before, after)
    refused, applied = refused + run_refused, applied + run_applied
    samples = int(saved["train_samples"])
    if cfg.data.train_samples is not None and cfg.data.train_samples != samples:
        refused.append(f"data.train_samples: {samples} -> {cfg.data.train_samples} (the data order depends on it)")
    needed = cfg.train.iters * cfg.train.global_batch_size
    if needed > samples:
        refused.append(f"train.iters={cfg.train.iters} needs {needed} training samples, but the run's data order "
                       f"was built for {samples} (data.train_samples: set it large enough when starting a run "
                       "you may extend)")
    if refused:
        raise ConfigError("resume: the checkpoint's run cannot continue with these changes:\n  "
                          + "\n  ".join(refused))
    if applied and announce:
        print("resume: applying changed settings:\n  " + "\n  ".join(applied), flush=True)
    return samples
