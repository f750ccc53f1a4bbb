"""The training loop: data → depth draw → DeepSpeed forward/backward/step → metrics, eval, sample."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import clip_grad_norm_
from megatron.core import parallel_state
from tqdm import tqdm

from grt_megatron import __version__
from grt_megatron.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    supersede_newer,
)
from grt_megatron.checkpoint.state import OptimizerState
from grt_megatron.data import DataError
from grt_megatron.device import device_tensor, device_zeros, set_tf32
from grt_megatron.distributed import (
    destroy_distributed,
    init_distributed,
    seed_everything,
)
from grt_megatron.generation import sample_text
from grt_megatron.model import (
    ConfigError,
    DepthSampler,
    GRTConfig,
    GRTLanguageModel,
    count_parameters,
    forward_flops_per_token,
    train_flops_per_token,
)
from grt_megatron.parallel import register_sequence_parallel_grad_hooks
from grt_megatron.parallel.pipeline import GRTPipelineModule
from grt_megatron.training.config import RunConfig
from grt_megatron.training.data import (
    default_train_samples,
    on_main_rank,
    sample_noise_seeds,
    setup_training_data,
)
from grt_megatron.training.engine import MegatronMPU, batch_layout, build_engine
from grt_megatron.training.metrics import MetricsLogger, peak_flops_per_device
from grt_megatron.training.resume import check_resume
from grt_megatron.training.run_dir import claim_run_dir
from grt_megatron.training.signals import StopRequests
from grt_megatron.training.step_guard import (
    LossSpikeDetector,
    TrainingDiverged,
    install_step_guard,
    weights_are_finite,
)


@dataclass
class TrainResult:
    final_train_loss: float
    final_valid_loss: float
    steps: int
    seconds: float
    sample: Optional[str]
    start_step: int = 0
    stopped_by: Optional[str] = None
    """The signal that ended training early (after a checkpoint), if any."""
    checkpoint: Optional[Path] = None
    skipped_steps: int = 0
    """Optimizer steps skipped in this process (non-finite or spiking loss / gradient norm)."""


def slurm_job() -> dict:
    """The SLURM job this process runs in, and how many times it was requeued (empty outside SLURM)."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    return {"job_id": os.environ["SLURM_JOB_ID"], "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            "nodes": os.environ.get("SLURM_JOB_NODELIST")}


class Trainer:
    def __init__(self, cfg: RunConfig, record: Optional[dict] = None):
        """`record`: the composed config (`config_yaml`) and command-line `overrides` to keep in
        `.hydra/`, written only once the run directory is claimed."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.checkpoint_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.info = init_distributed(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.timeout_minutes,
                                     cfg.train.deterministic)
        self.lock = self._claim_run_dir(record or {})
        try:
            self._build()
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def _claim_run_dir(self, record: dict):
        """Rank 0 locks `run.dir` and checks it before anything is written; every rank gets the verdict."""
        lock, refusal = None, None
        if self.info.is_main:
            try:
                lock = claim_run_dir(self.run_dir, self.cfg.resume, record.get("config_yaml"),
                                     record.get("overrides"))
            except ConfigError as err:
                refusal = str(err)
        box = [refusal]
        if self.info.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise ConfigError(box[0])
        return lock

    def _build(self) -> None:
        cfg = self.cfg
        self.tf32 = set_tf32(cfg.train.tf32)
        self.seq_length = cfg.seq_length
        self.resume_path, self.saved = self._select_checkpoint()
        if cfg.resume and self.saved is None and self.info.is_main:
            self._truncate_metrics(0)  # a run that died before its first checkpoint: start over
        # The data stream's length (its order depends on it) comes from the checkpoint, if any, so the
        # data is set up after the run-config check and before the model check (which needs the vocab).
        self.train_samples = default_train_samples(cfg)
        if self.saved is not None and self.saved.get("config") is not None:
            self.train_samples = int(self.saved["train_samples"])
        self.data = setup_training_data(cfg, self.run_dir, self.info, self.seq_length, self.train_samples,
                                        resuming=self.saved is not None)
        self.tokenizer = self.data.tokenizer
        self.model_config: GRTConfig = cfg.model_config(self.tokenizer.vocab_size)
        if self.saved is not None:
            if self.saved["tokenizer"]["sha256"] != self.tokenizer.identity:
                raise ConfigError(f"resume: {self.resume_path} was trained with tokenizer "
                                  f"{self.saved['tokenizer']['source']} "
                                  f"(sha256 {self.saved['tokenizer']['sha256'][:12]}), this run has "
                                  f"{self.tokenizer.source} (sha256 {self.tokenizer.identity[:12]})")
            check_resume(self.saved, cfg, self.model_config.to_dict(), self.info.is_main)
        if self.seq_length > self.model_config.max_sequence_length:
            raise ConfigError(f"train.seq_length={self.seq_length} exceeds model.max_sequence_length="
                              f"{self.model_config.max_sequence_length}")
        self.pipelined = cfg.parallel.pp > 1
        if self.pipelined:
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
            self.model = GRTPipelineModule(self.model_config, cfg.seed, cfg.parallel.pp, self.info.dp_size)
        else:
            self.model = GRTLanguageModel(self.model_config, init_seed=cfg.seed)
        if self.model_config.sequence_parallel:
            register_sequence_parallel_grad_hooks(self.model)
        self.micro_batch, self.accumulation = batch_layout(cfg, self.info.dp_size)
        # Clipping with fp32 and no ZeRO is done here, because only then DeepSpeed does not report
        # the grad norm it computes; every other layout clips inside DeepSpeed's optimizer wrapper.
        # (Pipelines need ZeRO >= 1, checked with the layout.)
        self.clip_here = cfg.deepspeed.zero_stage == 0 and cfg.train.precision == "fp32"
        self.engine = build_engine(self.model, cfg, self.info.dp_size, clip_in_deepspeed=not self.clip_here)
        OptimizerState(self.engine)  # an optimizer checkpoints cannot hold is refused now, not at the first save
        self.step_guard = install_step_guard(self.engine)
        self.spikes = LossSpikeDetector(cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
        self.skipped_in_a_row = self.skipped_total = 0
        self.sampler = DepthSampler.from_config(self.model_config, cfg.seed)
        if self.pipelined:
            # The pipeline runs whole micro-batches on every DP rank: evaluation uses the largest such
            # share of the validation set, checked now rather than at the first evaluation.
            rows = len(self.data.valid_rows)
            self.pipeline_eval_rows_per_rank = rows // (self.info.dp_size * self.micro_batch) * self.micro_batch
            if self.pipeline_eval_rows_per_rank == 0:
                raise DataError(f"the validation set ({rows} samples) is smaller than one micro-batch per "
                                "data-parallel rank")
        self.start_step = self.last_saved = 0
        if self.resume_path is not None:
            self._resume()
        self.last_step = self.start_step
        self.logger = MetricsLogger(self.run_dir, self.info.is_main, cfg.logging.wandb,
                                    cfg.logging.wandb_project, cfg.run.name, {**cfg.to_dict(), "slurm": slurm_job()})
        job = slurm_job()
        if self.info.is_main and job:
            print(f"SLURM job {job['job_id']}, restart {job['restart_count']}", flush=True)
        if self.info.is_main:
            self._write_run_info()
            self.tokenizer.save(self.run_dir / self.tokenizer.file_name)
        self.stop_requests = StopRequests()
        self.peak_flops = peak_flops_per_device(cfg.train.precision, cfg.logging.peak_tflops, tf32=self.tf32)

    # ---- checkpoints --------------------------------------------------------------------------
    def _select_checkpoint(self) -> tuple[Optional[Path], Optional[dict]]:
        """Rank 0 picks and verifies the checkpoint to resume from; every rank gets its choice."""
        spec = self.cfg.resume
        if spec is None:
            return None, None

        def pick():
            try:
                found, skipped = resolve_checkpoint(spec, self.checkpoint_root)
            except CheckpointError as err:
                raise ConfigError(str(err)) from None
            for s in skipped:
                print(f"resume: skipping {s.path} ({s.problem})", flush=True)
            if found is None:
                print(f"resume={spec}: no checkpoint in {self.checkpoint_root}; starting from step 0", flush=True)
                return None
            return str(found.path), found.state

        box = [on_main_rank(self.info, pick)]
        dist.broadcast_object_list(box, src=0)
        return (None, None) if box[0] is None else (Path(box[0][0]), box[0][1])

    def _layout(self) -> dict:
        c = self.cfg
        return {"world_size": self.info.world_size, "tp": c.parallel.tp, "pp": c.parallel.pp, "dp": self.info.dp_size,
                "sp": c.parallel.sp, "zero_stage": c.deepspeed.zero_stage, "precision": c.train.precision}

    def _resume(self) -> None:
        saved, path = self.saved, self.resume_path
        layout = saved["layout"]
        same_layout = all(layout[k] == v for k, v in self._layout().items() if k in ("world_size", "tp", "pp"))
        try:
            loaded = load_checkpoint(path, self.engine, self.pipelined, self.model_config.padded_vocab_size,
                                     restore_rngs=same_layout)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        self.start_step = self.last_saved = int(saved["step"])
        guard = saved.get("step_guard", {})
        self.spikes.history.extend(guard.get("loss_history", []))
        self.skipped_in_a_row = int(guard.get("skipped_in_a_row", 0))
        self.skipped_total = int(guard.get("skipped_total", 0))
        if not loaded["rng_restored"]:
            seed_everything(self.cfg.seed + self.start_step)  # per-rank states do not map onto other ranks
        if self.info.is_main:
            note = ""
            if not same_layout:
                note = (f"; saved with tp={layout['tp']} pp={layout['pp']} on {layout['world_size']} processes, "
                        "resharded")
            if not loaded["rng_restored"]:
                note += ", RNG states reseeded"
            print(f"resumed from {path} at step {self.start_step} ({saved['tokens']} tokens){note}", flush=True)
            self._truncate_metrics(self.start_step)
            if path.parent.resolve() == self.checkpoint_root.resolve():
                for moved in supersede_newer(self.checkpoint_root, self.start_step):
                    print(f"resume: moved newer checkpoint aside (abandoned timeline): {moved}", flush=True)
        dist.barrier()

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics logged after the checkpoint's step: the resumed run logs those steps again."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass  # a line cut short by a killed process
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)

    def save(self, step: int, reason: str) -> Path:
        c = self.cfg
        g = c.train.global_batch_size
        state = {
            "version": __version__, "step": step, "consumed_samples": step * g, "tokens": step * g * self.seq_length,
            "train_samples": self.train_samples, "seq_length": self.seq_length, "layout": self._layout(),
            "config": c.to_dict(), "model": self.model_config.to_dict(), "model_shape": self.model_config.shape_name,
            "tokenizer": self.tokenizer.describe(), "data_prefixes": self.data.prefixes, "reason": reason,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "step_guard": {"loss_history": list(self.spikes.history), "skipped_in_a_row": self.skipped_in_a_row,
                           "skipped_total": self.skipped_total},
        }
        if not weights_are_finite(self.engine):  # collective: every rank checks the weights it owns
            raise TrainingDiverged(f"step {step}: the weights are not finite; no checkpoint was written (the last "
                                   f"one, step {self.last_saved}, is kept): resume from it with a lower train.lr")
        permanent = bool(c.checkpoint.keep_every and step % c.checkpoint.keep_every == 0)
        start = time.perf_counter()
        path = save_checkpoint(self.checkpoint_root, step, self.engine, self.pipelined, self.tokenizer, state,
                               c.checkpoint.keep_last, permanent)
        self.last_saved = step
        if self.info.is_main:
            tqdm.write(f"step {step}: saved checkpoint {path} in {time.perf_counter() - start:.2f} s ({reason})")
        return path

    def _stop_requested(self) -> Optional[str]:
        """The signal any rank received (all ranks agree, so they stop at the same step)."""
        flag = device_tensor([self.stop_requests.signum or 0], dtype=torch.int64)
        if self.info.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None

    # ---- bookkeeping --------------------------------------------------------------------------
    def _write_run_info(self) -> None:
        info = {
            "version": __version__,
            "config": self.cfg.to_dict(),
            "model": self.model_config.to_dict(),
            "model_shape": self.model_config.shape_name,
            "parameters": count_parameters(self.model_config)["total"],
            # Nominal: the configured R (forward × 3); executed FLOPs of each step are in metrics.jsonl.
            "train_flops_per_token_nominal": 3 * forward_flops_per_token(self.model_config, self.seq_length)["total"],
            "tokenizer": self.tokenizer.describe(),
            "data_prefixes": self.data.prefixes,
            "train_samples": len(self.data.datasets.train),
            "valid_samples": len(self.data.valid_rows),
            "world_size": self.info.world_size,
            "slurm": slurm_job(),
        }
        tmp = self.run_dir / "run_info.json.tmp"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(self.run_dir / "run_info.json")

    def _to_device(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(rows).to(self.info.device)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def _dp_mean(self, value: torch.Tensor) -> float:
        value = value.detach().float().clone()
        if self.info.dp_size > 1:
            dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
            value /= self.info.dp_size
        return float(value.item())

    # ---- steps --------------------------------------------------------------------------------
    def _pipeline_micro_batches(self, rows: np.ndarray, seeds: list[int], depth: tuple[int, int]) -> list:
        """((tokens, noise seeds, depth), labels) per micro-batch: what DeepSpeed's pipeline engine feeds
        its first stage (the rest travels with the activations) and its last stage (labels)."""
        out = []
        for start in range(0, len(rows), self.micro_batch):
            tokens, labels = self._to_device(rows[start : start + self.micro_batch])
            # They travel between stages with the activations: on the device (NCCL's send/recv).
            extras = (device_tensor(seeds[start : start + self.micro_batch], dtype=torch.int64),
                      device_tensor(depth, dtype=torch.int64))
            out.append(((tokens, *extras), labels))
        return out

    def train_step(self, iteration: int) -> dict:
        cfg = self.cfg
        draw = self.sampler.draw(iteration)
        lr = float(self.engine.get_lr()[0])  # the rate this step's update uses
        per_rank = self.micro_batch * self.accumulation
        first_row = self.info.dp_rank * per_rank
        rows = self.data.train_rows(iteration, cfg.train.global_batch_size, first_row, per_rank)
        stats = {"lr": lr, "recurrences": draw.recurrences, "grad_recurrences": draw.grad_recurrences,
                 "flops_per_token": train_flops_per_token(self.model_config, self.seq_length, draw)}
        seeds = sample_noise_seeds(cfg.seed, iteration, range(first_row, first_row + per_rank))
        if self.pipelined:
            batches = self._pipeline_micro_batches(rows, seeds, (draw.recurrences, draw.grad_recurrences))
            loss = float(self.engine.train_batch(data_iter=iter(batches)))  # mean over micro-batches and DP
            reason = self.spikes.check(loss)  # known only after the step: logged, and skipped if non-finite
            return {**stats, "loss": loss, **self._step_outcome(None, reason)}
        total = device_zeros(dtype=torch.float32)
        grad_norm, reason, mean_loss = None, None, float("nan")
        for index, start in enumerate(range(0, per_rank, self.micro_batch)):
            tokens, labels = self._to_device(rows[start : start + self.micro_batch])
            loss = self.engine(tokens, labels, draw.recurrences, draw.grad_recurrences,
                               seeds[start : start + self.micro_batch]).mean()
            total += loss.detach().float()
            if index == self.accumulation - 1:
                # The step's loss is known before the last backward: a step to skip gets non-finite
                # gradients, which every layout's optimizer path then drops (step_guard.py).
                mean_loss = self._dp_mean(total / self.accumulation)
                reason = self.spikes.check(mean_loss)
                if iteration + 1 in cfg.train.inject_nan_at:
                    reason = "injected NaN (train.inject_nan_at)"
                if reason is not None and (reason != "loss spike" or cfg.train.skip_loss_spikes):
                    loss = loss * float("nan")
            self.engine.backward(loss)
            if self.clip_here and self.engine.is_gradient_accumulation_boundary():
                # max_norm inf measures the norm and leaves the gradients as they are (clipping off).
                grad_norm = float(clip_grad_norm_(list(self.engine.module.parameters()),
                                                  cfg.train.grad_clip or math.inf, mpu=MegatronMPU()))
            self.engine.step()
        return {**stats, "loss": mean_loss, **self._step_outcome(grad_norm, reason)}

    def _step_outcome(self, grad_norm: Optional[float], reason: Optional[str]) -> dict:
        """Grad norm and whether (and why) the optimizer step was skipped; counts skips."""
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        out = {"grad_norm": grad_norm}
        skipped = not self.engine.was_step_applied()
        if reason == "loss spike":
            out["loss_spike"] = True
        if skipped:
            self.skipped_total += 1
            out["skipped"] = True
            out["skip_reason"] = reason or "non-finite grad norm"
        # A pipeline learns its loss after the step: a non-finite one counts as a bad step even if the
        # gradients were finite and the step was taken.
        bad = skipped or reason == "non-finite loss"
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if bad else 0
        return out

    def evaluate_other_mor_routing(self) -> dict[str, float]:
        """MoR: the validation loss under the evaluation routing the run does not report as `loss`
        (`loss_topk_routing` or `loss_threshold_routing`), so both the causal and the training rule are
        on record. Empty for every other model."""
        if self.model_config.routing == "none":
            return {}
        block = self.engine.module.block
        other = "topk" if self.model_config.mor_eval_routing == "threshold" else "threshold"
        block.mor_eval_routing = other
        try:
            return {f"loss_{other}_routing": self.evaluate(record_stats=False)}
        finally:
            block.mor_eval_routing = self.model_config.mor_eval_routing

    @torch.no_grad()
    def evaluate(self, recurrences: Optional[int] = None, record_stats: bool = True) -> float:
        """Mean validation loss per token at the configured R (or `recurrences`), noise off (eval mode),
        over the fixed validation windows; data-parallel ranks share the windows and sum their losses.
        `record_stats`: keep the gate diagnostics of the first micro-batch in `eval_step_stats`."""
        if self.pipelined:
            return self._evaluate_pipelined(recurrences)
        self.engine.eval()
        mine = self.data.valid_rows[self.info.dp_rank :: self.info.dp_size]
        loss_sum, counted = device_zeros(dtype=torch.float64), 0  # loss summed over tokens, tokens
        block = self.engine.module.block
        for start in range(0, len(mine), self.micro_batch):
            tokens, labels = self._to_device(mine[start : start + self.micro_batch])
            first = start == 0 and record_stats
            block.step_stats = [] if first else None  # gate diagnostics from the first micro-batch
            loss = self.engine(tokens, labels, recurrences)
            if first:
                self.eval_step_stats = block.step_stats
            loss_sum += loss.double().sum()
            counted += loss.numel()
        block.step_stats = None
        self.engine.train()
        sums = torch.stack([loss_sum, device_tensor(float(counted), dtype=torch.float64)])
        if self.info.dp_size > 1:
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        return float(sums[0] / sums[1])

    def _evaluate_pipelined(self, recurrences: Optional[int] = None) -> float:
        per_rank = self.pipeline_eval_rows_per_rank
        mine = self.data.valid_rows[self.info.dp_rank * per_rank : (self.info.dp_rank + 1) * per_rank]
        r = recurrences or self.model_config.recurrences
        batches = self._pipeline_micro_batches(mine, [0] * len(mine), (r, r))
        loss = self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))  # eval mode: no noise
        return float(loss)

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch_size * self.seq_length
        start = time.perf_counter()
        progress = tqdm(range(self.start_step, cfg.train.iters), desc="train", unit="step", dynamic_ncols=True,
                        initial=self.start_step, total=cfg.train.iters,
                        disable=not (self.info.is_main and cfg.logging.progress))
        # SIGUSR1 (SLURM's warning before the time limit), SIGTERM (preemption) and Ctrl-C: finish the
        # step, save, and return (signals.py has the exit codes).
        loss, valid, stopped_by, checkpoint = float("nan"), float("nan"), None, None
        with self.stop_requests.installed():
            for iteration in progress:
                step = iteration + 1
                loss, valid = self._run_step(iteration, tokens_per_step, progress, valid)
                self._check_skipped(step, loss)
                every = cfg.checkpoint.interval
                if every and step % every == 0:
                    if self.skipped_in_a_row:  # keep the checkpoints from before the streak
                        if self.info.is_main:
                            progress.write(f"step {step}: interval checkpoint deferred: {self.skipped_in_a_row} "
                                           "skipped steps in a row")
                    else:
                        checkpoint = self.save(step, "interval")
                stopped_by = self._stop_requested()
                exit_every = cfg.train.exit_interval
                if not stopped_by and exit_every and step % exit_every == 0 and step < cfg.train.iters:
                    stopped_by = "train.exit_interval"
                if stopped_by:
                    if self.last_saved != step:
                        checkpoint = self.save(step, stopped_by)
                    break
            if not stopped_by and cfg.checkpoint.save_at_end and self.last_saved != cfg.train.iters:
                checkpoint = self.save(cfg.train.iters, "end")
        seconds = time.perf_counter() - start
        if not stopped_by and self.last_step == cfg.train.iters and self.start_step < cfg.train.iters:
            self.depth_sweep()
        sample = None
        if cfg.train.sample_tokens > 0 and not self.pipelined and not stopped_by:
            sample = sample_text(self.engine.module, self.tokenizer, cfg.train.sample_prompt,
                                 cfg.train.sample_tokens, seed=cfg.seed, device=self.info.device)
        return TrainResult(loss, valid, self.last_step, seconds, sample, self.start_step, stopped_by, checkpoint,
                           self.skipped_total)

    def _check_skipped(self, step: int, loss: float) -> None:
        limit = self.cfg.train.max_skipped_steps
        if self.skipped_in_a_row > limit:
            last = f"step {self.last_saved}" if self.last_saved else "none yet"
            raise TrainingDiverged(
                f"step {step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(loss {loss}) and were skipped, more than train.max_skipped_steps={limit}; stopping. The last "
                f"checkpoint ({last}) holds finite weights: resume from it with a lower train.lr")

    def _run_step(self, iteration: int, tokens_per_step: int, progress, valid: float) -> tuple[float, float]:
        cfg = self.cfg
        step_start = time.perf_counter()
        stats = self.train_step(iteration)
        seconds = time.perf_counter() - step_start
        step = self.last_step = iteration + 1
        loss = stats["loss"]
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "recurrences": stats["recurrences"],
            "grad_recurrences": stats["grad_recurrences"],
            "tokens": step * tokens_per_step,
            "step_seconds": seconds,
            "tokens_per_s": tokens_per_step / seconds,
            "flops_per_token": stats["flops_per_token"],  # model FLOPs at the R executed this step
            "flops_per_s": stats["flops_per_token"] * tokens_per_step / seconds,
        }
        if self.peak_flops:  # model FLOPs (executed R) over the peak of every device in the world
            record["mfu"] = record["flops_per_s"] / (self.peak_flops * self.info.world_size)
        record.update({key: stats[key] for key in ("loss_spike", "skipped", "skip_reason") if key in stats})
        if "skipped" in stats:
            record["skipped_steps"] = self.skipped_total
            if self.info.is_main:
                progress.write(f"step {step}: optimizer step skipped ({stats['skip_reason']}; loss {loss}, "
                               f"grad norm {stats['grad_norm']}); {self.skipped_in_a_row} in a row")
        if step % cfg.train.log_interval == 0 or step == cfg.train.iters or "skipped" in stats:
            self.logger.log(record)
        postfix = {"loss": f"{loss:.3f}", "R": stats["recurrences"], "tok/s": f"{record['tokens_per_s']:.0f}"}
        if "mfu" in record:
            postfix["MFU"] = f"{100 * record['mfu']:.1f}%"
        progress.set_postfix(postfix, refresh=False)
        if step % cfg.train.eval_interval == 0 or step == cfg.train.iters:
            self.eval_step_stats = []
            valid = self.evaluate()
            # Per recurrence: the mean gate value and ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ — does the gate learn,
            # does the state still move (first validation micro-batch; not with pipeline stages).
            gates = {f"{key}_r{r + 1}": value for r, stats in enumerate(self.eval_step_stats or [])
                     for key, value in stats.items() if value == value}  # NaN: no gate in this model
            self.logger.log({"step": step, "split": "valid", "loss": valid,
                             "perplexity": float(np.exp(min(valid, 50.0))),
                             "recurrences": self.model_config.recurrences, **gates,
                             **self.evaluate_other_mor_routing()})
            if self.info.is_main:
                progress.write(f"step {step}: train loss {loss:.4f}, valid loss {valid:.4f} "
                               f"(R={self.model_config.recurrences})")
        return loss, valid

    def depth_sweep(self) -> None:
        """Validation loss at R = 1 … R + `train.depth_sweep`: how the model behaves when run with fewer or
        more recurrences than it was evaluated at (one `split: depth_sweep` record per R)."""
        extra = self.cfg.train.depth_sweep
        cfg = self.model_config
        if extra is None or cfg.is_dense:
            return
        # MoR has one router per trained recursion: it cannot run deeper than it was trained.
        top = cfg.recurrences if cfg.routing != "none" else cfg.recurrences + extra
        for r in tqdm(range(1, top + 1), desc="depth sweep", unit="R", dynamic_ncols=True,
                      disable=not (self.info.is_main and self.cfg.logging.progress)):
            loss = self.evaluate(recurrences=r)
            self.logger.log({"step": self.last_step, "split": "depth_sweep", "recurrences": r, "loss": loss,
                             "flops_per_token": forward_flops_per_token(cfg, self.seq_length, r)["total"]})
        if self.info.is_main:
            print(f"depth sweep: validation loss at R = 1 … {top} logged to metrics.jsonl", flush=True)

    def close(self) -> None:
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        destroy_distributed()


def run_training(cfg: RunConfig, record: Optional[dict] = None) -> TrainResult:
    """Train `cfg`; `record` is what to keep in `.hydra/` (the CLI's composed config and overrides)."""
    trainer = Trainer(cfg, record)
    try:
        return trainer.train()
    finally:
        trainer.close()
