"""The training loop: data → depth draw → step runner (DeepSpeed forward/backward/step) → metrics, eval, saves.

Set-up is `Trainer.__init__` (run directory, data, model through `parallelize`, resume); the loop is
`Trainer.train`; one step's work is the step runner's (plain or pipelined: step_runner.py), validation
the evaluator's (evaluation.py), resuming resume.py's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from grt_megatron import __version__
from grt_megatron.checkpoint import save_checkpoint
from grt_megatron.checkpoint.async_save import AsyncSaver
from grt_megatron.checkpoint.checkpointer import snapshot_checkpoint
from grt_megatron.checkpoint.state import OptimizerState
from grt_megatron.device import set_tf32, slow_bf16_warning
from grt_megatron.distributed import destroy_distributed, init_distributed
from grt_megatron.files import write_atomic
from grt_megatron.generation import sample_text
from grt_megatron.model import (
    ConfigError,
    DepthSampler,
    GRTConfig,
    count_parameters,
    forward_flops_per_token,
    train_flops_per_token,
)
from grt_megatron.model.kernels import KERNEL_FIELDS, describe_kernels
from grt_megatron.parallel.compile import compiled_graphs
from grt_megatron.parallel.parallelize import parallelize
from grt_megatron.training.config import RunConfig
from grt_megatron.training.data import BatchPrefetcher, default_train_samples, on_main_rank, setup_training_data
from grt_megatron.training.evaluation import Evaluator
from grt_megatron.training.probe import DepthProbe
from grt_megatron.training.metrics import MetricsLogger, peak_flops_per_device
from grt_megatron.training.resume import check_resume, restore_checkpoint, select_checkpoint, truncate_metrics
from grt_megatron.training.run_dir import check_folder_setting, claim_run_dir, record_run
from grt_megatron.training.signals import StopRequests
from grt_megatron.training.step_guard import (
    LossSpikeDetector,
    TrainingDiverged,
    install_step_guard,
    weights_are_finite,
)
from grt_megatron.training.step_runner import StepOutput, build_step_runner


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


class StopAgreement:
    """Whether any rank was asked to stop, agreed by every rank without stalling a step: each step this
    rank's signal goes into a MAX all-reduce of a host tensor (gloo; on GPU the group is
    `cpu:gloo,cuda:nccl`), started without waiting, and the previous step's result is read. Every rank
    stops at the same step: the one after the step the signal arrived in (that step, in a world of one)."""

    def __init__(self, requests: StopRequests, world_size: int):
        self.requests, self.world_size = requests, world_size
        self.pending = None  # the previous step's (flag, work)

    def poll(self) -> Optional[str]:
        """The signal to stop for, once every rank knows it; None to go on."""
        mine = self.requests.signum or 0
        if self.world_size == 1:
            return signal.Signals(mine).name if mine else None
        if self.pending is not None:
            flag, work = self.pending
            work.wait()
            self.pending = None
            if flag.item():
                return signal.Signals(int(flag.item())).name
        flag = torch.tensor([mine], dtype=torch.int64, device="cpu")  # host: reading it syncs no device
        self.pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        return None

    def __enter__(self) -> "StopAgreement":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Every rank started the same last reduction: finish it (not when failing: a peer may be gone).
        if self.pending is not None and exc_type is None:
            self.pending[1].wait()
            self.pending = None


class Trainer:
    def __init__(self, cfg: RunConfig, record: Optional[dict] = None):
        """`record`: the composed config (`config_yaml`) and command-line `overrides` to keep in
        `.hydra/`, written only once the run directory is claimed."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.checkpoint_root = cfg.checkpoint_root
        self.info = init_distributed(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.timeout_minutes,
                                     cfg.train.deterministic)
        record = record or {}
        # Rank 0 locks run.dir and checks it before anything is written; every rank gets the verdict (the
        # lock is rank 0's alone, None elsewhere).
        on_main_rank(self.info, lambda: [check_folder_setting(setting, folder) for setting, folder in (
            ("checkpoint.dir", self.checkpoint_root), ("data.cache_dir", cfg.data.cache_dir)) if folder])
        self.lock = on_main_rank(self.info, lambda: claim_run_dir(self.run_dir, cfg.resume))
        try:
            self._build()
            on_main_rank(self.info, lambda: record_run(self.run_dir, record.get("config_yaml"),
                                                       record.get("overrides")))
        except BaseException:
            if self.lock is not None:
                self.lock.release_refused()
            raise

    def _build(self) -> None:
        cfg, info = self.cfg, self.info
        self.tf32 = set_tf32(cfg.train.tf32)
        self.seq_length = cfg.seq_length
        self.resume_path, self.saved = select_checkpoint(cfg.resume, self.checkpoint_root, info)
        if cfg.resume and self.saved is None and info.is_main:
            truncate_metrics(self.run_dir, 0)  # a run that died before its first checkpoint: start over
        # The data stream's length (its order depends on it) comes from the checkpoint, if any, so the
        # data is set up after the run-config check and before the model check (which needs the vocab).
        self.train_samples = default_train_samples(cfg)
        if self.saved is not None and self.saved.get("config") is not None:
            self.train_samples = int(self.saved["train_samples"])
        self.data = setup_training_data(cfg, self.run_dir, info, self.seq_length, self.train_samples,
                                        resuming=self.saved is not None)
        self.tokenizer = self.data.tokenizer
        self.model_config: GRTConfig = cfg.model_config(self.tokenizer.vocab_size)
        if self.saved is not None:
            if self.saved["tokenizer"]["sha256"] != self.tokenizer.identity:
                raise ConfigError(f"resume: {self.resume_path} was trained with tokenizer "
                                  f"{self.saved['tokenizer']['source']} "
                                  f"(sha256 {self.saved['tokenizer']['sha256'][:12]}), this run has "
                                  f"{self.tokenizer.source} (sha256 {self.tokenizer.identity[:12]})")
            check_resume(self.saved, cfg, self.model_config.to_dict(), info.is_main)
        if self.seq_length > self.model_config.max_sequence_length:
            raise ConfigError(f"train.seq_length={self.seq_length} exceeds model.max_sequence_length="
                              f"{self.model_config.max_sequence_length}")
        self.parallel = parallelize(self.model_config, cfg)
        self.engine, self.pipelined = self.parallel.engine, self.parallel.pipelined
        OptimizerState(self.engine)  # an optimizer checkpoints cannot hold is refused now, not at the first save
        self.step_guard = install_step_guard(self.engine)
        self.spikes = LossSpikeDetector(cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
        self.skipped_in_a_row = self.skipped_total = 0
        self.sampler = DepthSampler.from_config(self.model_config, cfg.seed)
        self.runner = build_step_runner(self.parallel, cfg, info, self.spikes, len(self.data.valid_rows),
                                        self.data.loss_mask,
                                        self.tokenizer.eos_id if cfg.data.reset_attention_mask else None,
                                        self.step_guard)
        self.start_step = self.last_saved = 0
        self.saver = AsyncSaver() if cfg.checkpoint.async_save else None
        if self.resume_path is not None:
            restored = restore_checkpoint(self.resume_path, self.saved, self.engine, self.pipelined,
                                          self.model_config.padded_vocab_size, self._layout(), cfg, info,
                                          self.checkpoint_root, self.run_dir)
            self.start_step = self.last_saved = restored.step
            self.spikes.history.extend(restored.step_guard.get("loss_history", []))
            self.skipped_in_a_row = int(restored.step_guard.get("skipped_in_a_row", 0))
            self.skipped_total = int(restored.step_guard.get("skipped_total", 0))
        self.last_step = self.start_step
        job = slurm_job()
        self.logger = MetricsLogger(self.run_dir, info.is_main, cfg.logging.wandb, cfg.logging.wandb_project,
                                    cfg.run.name, {**cfg.to_dict(), "slurm": job})
        probe = None
        if cfg.probe.task is not None:
            pad = cfg.parallel.tp if cfg.parallel.sp else 1  # sequence parallelism splits the sequence over TP
            probe = DepthProbe(cfg.probe, self.tokenizer, self.seq_length, pad_multiple=pad,
                               prefixes=self.data.prefixes)
        self.evaluator = Evaluator(self.runner, self.model_config, self.data.valid_rows, self.logger,
                                   self.seq_length, cfg.logging.progress, probe)
        if info.is_main and job:
            print(f"SLURM job {job['job_id']}, restart {job['restart_count']}", flush=True)
        if info.is_main:
            print(f"kernels: {describe_kernels(self.model_config)}", flush=True)
            if self.parallel.pipelined:
                print(f"pipeline stages: {self.parallel.engine.module.describe_stages()}", flush=True)
            slow = slow_bf16_warning(cfg.train.precision, info.device)
            if slow:
                print(slow, flush=True)
            self._write_run_info()
            self.tokenizer.save(self.run_dir / self.tokenizer.file_name)
        self.stop_requests = StopRequests()
        self.stop_agreement = StopAgreement(self.stop_requests, info.world_size)
        self.peak_flops = peak_flops_per_device(cfg.train.precision, cfg.logging.peak_tflops, tf32=self.tf32)

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        start = time.perf_counter()
        per_rank = self.parallel.micro_batch * self.parallel.accumulation
        batches = BatchPrefetcher(self.data, cfg.seed, cfg.train.global_batch_size, self.info.dp_rank * per_rank,
                                  per_rank, self.start_step, cfg.train.iters, pin=self.info.device.type == "cuda")
        progress = tqdm(batches, desc="train", unit="step", dynamic_ncols=True, initial=self.start_step,
                        total=cfg.train.iters, disable=not (self.info.is_main and cfg.logging.progress))
        # SIGUSR1 (SLURM's warning before the time limit), SIGTERM (preemption) and Ctrl-C: finish the
        # step, save, and return (signals.py has the exit codes).
        loss, valid, stopped_by, checkpoint = float("nan"), float("nan"), None, None
        with self.stop_requests.installed(), self.stop_agreement, closing(batches):
            for iteration, (rows, seeds, weights) in progress:
                step = self.last_step = iteration + 1
                loss = self._train_step(iteration, rows, seeds, weights, progress)
                if step % cfg.train.eval_interval == 0 or step == cfg.train.iters:
                    valid = self.evaluator.validate(step)
                    if self.info.is_main:
                        progress.write(f"step {step}: train loss {loss:.4f}, valid loss {valid:.4f} "
                                       f"(R={self.model_config.recurrences})")
                self._check_skipped(step, loss)
                if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                    if self.skipped_in_a_row:  # keep the checkpoints from before the streak
                        if self.info.is_main:
                            progress.write(f"step {step}: interval checkpoint deferred: {self.skipped_in_a_row} "
                                           "skipped steps in a row")
                    else:
                        checkpoint = self.save(step, "interval")
                stopped_by = self.stop_agreement.poll()
                exit_every = cfg.train.exit_interval
                if not stopped_by and exit_every and step % exit_every == 0 and step < cfg.train.iters:
                    stopped_by = "train.exit_interval"
                if stopped_by:
                    if self.last_saved != step:
                        checkpoint = self.save(step, stopped_by)
                    break
            if not stopped_by and cfg.checkpoint.save_at_end and self.last_saved != cfg.train.iters:
                checkpoint = self.save(cfg.train.iters, "end")
            if self.saver is not None:
                self.saver.wait()  # the run ends with its last checkpoint committed (or its failure raised)
        seconds = time.perf_counter() - start
        finished = not stopped_by and self.last_step == cfg.train.iters and self.start_step < cfg.train.iters
        if finished and cfg.train.depth_sweep is not None:
            self.evaluator.depth_sweep(self.last_step, cfg.train.depth_sweep, self.info.is_main)
        sample = None
        if cfg.train.sample_tokens > 0 and not self.pipelined and not stopped_by:
            sample = sample_text(self.engine.module, self.tokenizer, cfg.train.sample_prompt,
                                 cfg.train.sample_tokens, seed=cfg.seed, device=self.info.device)
        return TrainResult(loss, valid, self.last_step, seconds, sample, self.start_step, stopped_by, checkpoint,
                           self.skipped_total)

    def _train_step(self, iteration: int, rows: torch.Tensor, seeds: list[int], weights, progress) -> float:
        """One optimizer step on this rank's `rows` of the iteration, its metrics record and progress line;
        returns its loss."""
        cfg = self.cfg
        started = time.perf_counter()
        draw = self.sampler.draw(iteration)
        lr = float(self.engine.get_lr()[0])  # the rate this step's update uses
        out = self.runner.train_step(rows, seeds, draw, iteration, weights)
        seconds = time.perf_counter() - started
        step, tokens = iteration + 1, cfg.train.global_batch_size * self.seq_length
        flops = train_flops_per_token(self.model_config, self.seq_length, draw)
        outcome = self._step_outcome(out)
        record = {"step": step, "loss": out.loss, "grad_norm": outcome.pop("grad_norm"), "lr": lr,
                  "recurrences": draw.recurrences, "grad_recurrences": draw.grad_recurrences,
                  "tokens": step * tokens, "step_seconds": seconds, "tokens_per_s": tokens / seconds,
                  "flops_per_token": flops,  # model FLOPs at the R executed this step
                  "flops_per_s": flops * tokens / seconds}
        if self.peak_flops:  # model FLOPs (executed R) over the peak of every device in the world
            record["mfu"] = record["flops_per_s"] / (self.peak_flops * self.info.world_size)
        record.update(outcome)
        if cfg.train.compile:
            record["compiled_graphs"] = compiled_graphs()
        logged = step % cfg.train.log_interval == 0 or step == cfg.train.iters or "skipped" in record
        if logged and record["grad_norm"] is not None:
            # DeepSpeed's wrappers leave their norm on the device: read only for a record that is written.
            record["grad_norm"] = float(record["grad_norm"])
        if "skipped" in record:
            record["skipped_steps"] = self.skipped_total
            if self.info.is_main:
                progress.write(f"step {step}: optimizer step skipped ({record['skip_reason']}; loss {out.loss}, "
                               f"grad norm {record['grad_norm']}); {self.skipped_in_a_row} in a row")
        if logged:
            self.logger.log(record)
        postfix = {"loss": f"{out.loss:.3f}", "R": draw.recurrences, "tok/s": f"{record['tokens_per_s']:.0f}"}
        if "mfu" in record:
            postfix["MFU"] = f"{100 * record['mfu']:.1f}%"
        progress.set_postfix(postfix, refresh=False)
        return out.loss

    def _step_outcome(self, out: StepOutput) -> dict:
        """Grad norm and whether (and why) the optimizer step was skipped; counts skips."""
        grad_norm = self.engine.get_global_grad_norm() if out.grad_norm is None else out.grad_norm
        result = {"grad_norm": grad_norm}  # a float, a device tensor (DeepSpeed's) or None
        skipped = not self.engine.was_step_applied()
        if out.skip_reason == "loss spike":
            result["loss_spike"] = True
        if skipped:
            self.skipped_total += 1
            result["skipped"] = True
            result["skip_reason"] = out.skip_reason or "non-finite grad norm"
        # A pipeline learns its loss after the step: a non-finite one counts as a bad step even if the
        # gradients were finite and the step was taken.
        bad = skipped or out.skip_reason == "non-finite loss"
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if bad else 0
        return result

    def _check_skipped(self, step: int, loss: float) -> None:
        limit = self.cfg.train.max_skipped_steps
        if self.skipped_in_a_row > limit:
            last = f"step {self.last_saved}" if self.last_saved else "none yet"
            raise TrainingDiverged(
                f"step {step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(loss {loss}) and were skipped, more than train.max_skipped_steps={limit}; stopping. The last "
                f"checkpoint ({last}) holds finite weights: resume from it with a lower train.lr")

    # ---- checkpoints and records --------------------------------------------------------------
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
        if self.saver is not None:
            self.saver.wait()  # never two saves in flight
            snapshot = snapshot_checkpoint(self.checkpoint_root, step, self.engine, self.pipelined, self.tokenizer,
                                           state, c.checkpoint.keep_last, permanent, copy=True)
            blocked = time.perf_counter() - start
            main = self.info.is_main

            def committed(path: Path, seconds: float) -> None:
                if main:
                    tqdm.write(f"step {step}: saved checkpoint {path} in {seconds:.2f} s in the background "
                               f"(training waited {blocked:.2f} s; {reason})")

            self.saver.submit(snapshot, committed)
            self.last_saved = step
            return snapshot.path
        path = save_checkpoint(self.checkpoint_root, step, self.engine, self.pipelined, self.tokenizer, state,
                               c.checkpoint.keep_last, permanent)
        self.last_saved = step
        if self.info.is_main:
            tqdm.write(f"step {step}: saved checkpoint {path} in {time.perf_counter() - start:.2f} s ({reason})")
        return path

    def _layout(self) -> dict:
        c = self.cfg
        return {"world_size": self.info.world_size, "tp": c.parallel.tp, "pp": c.parallel.pp, "dp": self.info.dp_size,
                "sp": c.parallel.sp, "zero_stage": c.deepspeed.zero_stage, "precision": c.train.precision,
                "pp_split_points": self.engine.module.split_points if self.pipelined else []}

    def _write_run_info(self) -> None:
        info = {
            "version": __version__,
            "config": self.cfg.to_dict(),
            "model": self.model_config.to_dict(),
            "model_shape": self.model_config.shape_name,
            "kernels": {name: getattr(self.model_config, name) for name in KERNEL_FIELDS},  # as resolved here
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
        write_atomic(self.run_dir / "run_info.json", json.dumps(info, indent=2))

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
