"""Resuming a run: which checkpoint (`select_checkpoint`), whether the run can continue from it with the
settings it is resumed with (`check_resume`), putting its state back (`restore_checkpoint`), and the
metrics logged after it dropped (`truncate_metrics`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from grt_megatron.checkpoint import (
    CheckpointError,
    compare_configs,
    compare_models,
    load_checkpoint,
    resolve_checkpoint,
    supersede_newer,
)
from grt_megatron.checkpoint.store import verification_shares, verify_files
from grt_megatron.distributed import DistributedInfo, seed_everything
from grt_megatron.files import write_atomic
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


def select_checkpoint(spec: Optional[str], checkpoint_root: Path, info: DistributedInfo
                      ) -> tuple[Optional[Path], Optional[dict]]:
    """Rank 0 picks the checkpoint `resume=spec` names, every rank hashing its share of each candidate's
    files (`verification_shares`: a large checkpoint is not hashed by one rank while the others wait in a
    collective); every rank gets its (path, state)."""
    if spec is None:
        return None, None

    def spread_verify(path: Path, files: dict) -> Optional[str]:
        box = [("verify", str(path), files)]
        dist.broadcast_object_list(box, src=0)  # the other ranks are waiting in `serve` below
        return _verify_share(path, files, info)

    def pick():
        try:
            found, skipped = resolve_checkpoint(spec, checkpoint_root, verify=spread_verify)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        for s in skipped:
            print(f"resume: skipping {s.path} ({s.problem})", flush=True)
        if found is None:
            print(f"resume={spec}: no checkpoint in {checkpoint_root}; starting from step 0", flush=True)
            return None
        return str(found.path), found.state

    if info.is_main:
        result, failure = None, None
        try:
            result = pick()
        except ConfigError as err:
            failure = str(err)
        box = [("done", result, failure)]
        dist.broadcast_object_list(box, src=0)
    else:
        while True:  # serve rank 0's verification requests until it has decided
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] != "verify":
                break
            _verify_share(Path(box[0][1]), box[0][2], info)
    _, result, failure = box[0]
    if failure is not None:
        raise ConfigError(failure)
    return (None, None) if result is None else (Path(result[0]), result[1])


def _verify_share(path: Path, files: dict, info: DistributedInfo) -> Optional[str]:
    """Hash this rank's share of the files; the first problem any rank found (the same on every rank)."""
    share = verification_shares(files, info.world_size)[info.rank]
    problems: list = [None] * info.world_size
    dist.all_gather_object(problems, verify_files(path, files, share))
    return next((p for p in problems if p), None)


@dataclass
class Restored:
    step: int
    step_guard: dict = field(default_factory=dict)
    """The non-finite-step bookkeeping saved with the checkpoint (loss history, skip counters)."""


def restore_checkpoint(path: Path, saved: dict, engine, pipelined: bool, padded_vocab_size: int,
                       layout: dict, cfg: RunConfig, info: DistributedInfo, checkpoint_root: Path,
                       run_dir: Path) -> Restored:
    """Load `path` into the engine (resharded if the layout changed), reseed where the saved RNG states do
    not map onto this layout, drop later metrics and move newer checkpoints of an abandoned timeline aside."""
    saved_layout = saved["layout"]
    same_layout = all(saved_layout[k] == layout[k] for k in ("world_size", "tp", "pp"))
    # Where the pipeline's stages begin: a layer on another stage would draw its dropout from another rank's
    # RNG stream. Checkpoints before 2026-12-07 do not say (their stages were balanced by layer count).
    saved_split = saved_layout.get("pp_split_points", [] if saved_layout["pp"] == 1 else None)
    same_stages = same_layout and saved_split == layout["pp_split_points"]
    try:
        loaded = load_checkpoint(path, engine, pipelined, padded_vocab_size, restore_rngs=same_stages)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    step = int(saved["step"])
    if not loaded["rng_restored"]:
        seed_everything(cfg.seed + step)  # per-rank states do not map onto other ranks
    if info.is_main:
        note = ""
        if not same_layout:
            note = (f"; saved with tp={saved_layout['tp']} pp={saved_layout['pp']} on "
                    f"{saved_layout['world_size']} processes, resharded")
        elif not same_stages:
            where = "by layer count" if saved_split is None else f"at {saved_split}"
            note = f"; saved with pipeline stages split {where}, now at {layout['pp_split_points']}"
        if not loaded["rng_restored"]:
            note += ", RNG states reseeded"
        print(f"resumed from {path} at step {step} ({saved['tokens']} tokens){note}", flush=True)
        truncate_metrics(run_dir, step)
        if path.parent.resolve() == checkpoint_root.resolve():
            for moved in supersede_newer(checkpoint_root, step):
                print(f"resume: moved newer checkpoint aside (abandoned timeline): {moved}", flush=True)
    dist.barrier()
    return Restored(step, saved.get("step_guard", {}))


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics logged after `step`: the resumed run logs those steps again."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by a killed process
    write_atomic(path, "".join(line + "\n" for line in kept))
