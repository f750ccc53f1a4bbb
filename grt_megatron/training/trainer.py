"""The training loop: data → depth draw → DeepSpeed forward/backward/step → metrics, eval, sample."""

from __future__ import annotations

import json
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
from grt_megatron.data import DataError
from grt_megatron.distributed import destroy_distributed, init_distributed
from grt_megatron.generation import sample_text
from grt_megatron.model import (
    ConfigError,
    DepthSampler,
    GRTConfig,
    GRTLanguageModel,
    count_parameters,
    train_flops_per_token,
)
from grt_megatron.parallel import register_sequence_parallel_grad_hooks
from grt_megatron.parallel.pipeline import GRTPipelineModule
from grt_megatron.training.config import RunConfig
from grt_megatron.training.data import sample_noise_seeds, setup_training_data
from grt_megatron.training.engine import MegatronMPU, batch_layout, build_engine
from grt_megatron.training.metrics import MetricsLogger


@dataclass
class TrainResult:
    final_train_loss: float
    final_valid_loss: float
    steps: int
    seconds: float
    sample: Optional[str]


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        if (self.run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"run.dir={str(self.run_dir)!r} already holds a run (metrics.jsonl); "
                              "choose a new run.dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.info = init_distributed(cfg.parallel.tp, cfg.parallel.pp, cfg.seed)
        self.seq_length = cfg.seq_length
        self.data = setup_training_data(cfg, self.run_dir, self.info, self.seq_length)
        self.tokenizer = self.data.tokenizer
        self.model_config: GRTConfig = cfg.model_config(self.tokenizer.vocab_size)
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
        self.sampler = DepthSampler.from_config(self.model_config, cfg.seed)
        if self.pipelined:
            # The pipeline runs whole micro-batches on every DP rank: evaluation uses the largest such
            # share of the validation set, checked now rather than at the first evaluation.
            rows = len(self.data.valid_rows)
            self.pipeline_eval_rows_per_rank = rows // (self.info.dp_size * self.micro_batch) * self.micro_batch
            if self.pipeline_eval_rows_per_rank == 0:
                raise DataError(f"the validation set ({rows} samples) is smaller than one micro-batch per "
                                "data-parallel rank")
        self.logger = MetricsLogger(self.run_dir, self.info.is_main, cfg.logging.wandb,
                                    cfg.logging.wandb_project, cfg.run.name, cfg.to_dict())
        if self.info.is_main:
            self._write_run_info()
            self.tokenizer.save(self.run_dir / self.tokenizer.file_name)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _write_run_info(self) -> None:
        info = {
            "version": __version__,
            "config": self.cfg.to_dict(),
            "model": self.model_config.to_dict(),
            "model_shape": self.model_config.shape_name,
            "parameters": count_parameters(self.model_config)["total"],
            "tokenizer": self.tokenizer.describe(),
            "data_prefixes": self.data.prefixes,
            "train_samples": len(self.data.datasets.train),
            "valid_samples": len(self.data.valid_rows),
            "world_size": self.info.world_size,
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
            extras = (torch.tensor(seeds[start : start + self.micro_batch], dtype=torch.int64),
                      torch.tensor(depth, dtype=torch.int64))
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
            loss = self.engine.train_batch(data_iter=iter(batches))  # mean over micro-batches and DP
            grad_norm = self.engine.get_global_grad_norm()
            return {**stats, "loss": float(loss), "grad_norm": None if grad_norm is None else float(grad_norm)}
        total = torch.zeros((), dtype=torch.float32, device=self.info.device)
        grad_norm = None
        for start in range(0, per_rank, self.micro_batch):
            tokens, labels = self._to_device(rows[start : start + self.micro_batch])
            loss = self.engine(tokens, labels, draw.recurrences, draw.grad_recurrences,
                               seeds[start : start + self.micro_batch]).mean()
            self.engine.backward(loss)
            if self.clip_here and self.engine.is_gradient_accumulation_boundary():
                grad_norm = float(clip_grad_norm_(list(self.engine.module.parameters()),
                                                  cfg.train.grad_clip, mpu=MegatronMPU()))
            self.engine.step()
            total += loss.detach().float()
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        return {**stats, "loss": self._dp_mean(total / self.accumulation),
                "grad_norm": None if grad_norm is None else float(grad_norm)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per token at the configured R, noise off (eval mode), over the fixed
        validation windows; data-parallel ranks share the windows and sum their losses."""
        if self.pipelined:
            return self._evaluate_pipelined()
        self.engine.eval()
        mine = self.data.valid_rows[self.info.dp_rank :: self.info.dp_size]
        sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)  # loss sum, token count
        for start in range(0, len(mine), self.micro_batch):
            tokens, labels = self._to_device(mine[start : start + self.micro_batch])
            loss = self.engine(tokens, labels)
            sums += torch.stack([loss.double().sum(), torch.tensor(loss.numel(), dtype=torch.float64)])
        self.engine.train()
        if self.info.dp_size > 1:
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        return float(sums[0] / sums[1])

    def _evaluate_pipelined(self) -> float:
        per_rank = self.pipeline_eval_rows_per_rank
        mine = self.data.valid_rows[self.info.dp_rank * per_rank : (self.info.dp_rank + 1) * per_rank]
        r = self.model_config.recurrences
        batches = self._pipeline_micro_batches(mine, [0] * len(mine), (r, r))
        loss = self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))  # eval mode: no noise
        return float(loss)

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch_size * self.seq_length
        start = time.perf_counter()
        progress = tqdm(range(cfg.train.iters), desc="train", unit="step", dynamic_ncols=True,
                        disable=not (self.info.is_main and cfg.logging.progress))
        loss, valid = float("nan"), float("nan")
        for iteration in progress:
            step_start = time.perf_counter()
            stats = self.train_step(iteration)
            seconds = time.perf_counter() - step_start
            step = iteration + 1
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
                "flops_per_s": stats["flops_per_token"] * tokens_per_step / seconds,
            }
            if step % cfg.train.log_interval == 0 or step == cfg.train.iters:
                self.logger.log(record)
            progress.set_postfix(loss=f"{loss:.3f}", R=stats["recurrences"], refresh=False)
            if step % cfg.train.eval_interval == 0 or step == cfg.train.iters:
                valid = self.evaluate()
                self.logger.log({"step": step, "split": "valid", "loss": valid,
                                 "perplexity": float(np.exp(min(valid, 50.0))),
                                 "recurrences": self.model_config.recurrences})
                if self.info.is_main:
                    progress.write(f"step {step}: train loss {loss:.4f}, valid loss {valid:.4f} "
                                   f"(R={self.model_config.recurrences})")
        seconds = time.perf_counter() - start
        sample = None
        if cfg.train.sample_tokens > 0 and not self.pipelined:
            sample = sample_text(self.engine.module, self.tokenizer, cfg.train.sample_prompt,
                                 cfg.train.sample_tokens, seed=cfg.seed, device=self.info.device)
        return TrainResult(loss, valid, cfg.train.iters, seconds, sample)

    def close(self) -> None:
        self.logger.close()
        destroy_distributed()


def run_training(cfg: RunConfig) -> TrainResult:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
