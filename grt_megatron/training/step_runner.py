"""One optimizer step, and one validation pass, on the parallel model: the plain way and the pipelined way.

The loop (trainer.py) calls `train_step` and `validation_loss` and never asks which layout it runs.
Both implementations see the same rows, noise seeds and depth draw, so every layout computes one
process's numbers (tests/test_parallel_layouts.py).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from grt_megatron.data import DataError
from grt_megatron.device import device_tensor, device_zeros
from grt_megatron.distributed import DistributedInfo
from grt_megatron.model import DepthDraw
from grt_megatron.model.layers import document_ids_of
from grt_megatron.model.diagnostics import recording_recurrence_stats
from grt_megatron.parallel.parallelize import ParallelModel
from grt_megatron.parallel.pipeline import PipelineUnit
from grt_megatron.training.config import RunConfig
from grt_megatron.training.step_guard import LossSpikeDetector, NonFiniteStepGuard, clip_grad_norm


@dataclass
class StepOutput:
    loss: float
    """The step's mean training loss over micro-batches and data-parallel ranks."""
    grad_norm: Optional[float]
    """Measured by the runner (fp32 without ZeRO); None: DeepSpeed's own."""
    skip_reason: Optional[str]
    """Why the step's update is to be skipped (non-finite loss, a spike, an injected NaN), else None."""


class StepRunner:
    def __init__(self, parallel: ParallelModel, cfg: RunConfig, info: DistributedInfo, spikes: LossSpikeDetector,
                 loss_mask: Optional[Callable[[np.ndarray], np.ndarray]] = None, document_eos: Optional[int] = None):
        self.engine = parallel.engine
        self.micro_batch, self.accumulation = parallel.micro_batch, parallel.accumulation
        self.cfg, self.info, self.spikes = cfg, info, spikes
        self.loss_mask = loss_mask
        """rows -> weights of the label positions the loss counts (`data.loss_on=answers`); None: all."""
        self.document_eos = document_eos
        """`data.reset_attention_mask`: the EOS id that closes each packed document; None: plain causal."""

    def train_step(self, rows: torch.Tensor, seeds: Sequence[int], draw: DepthDraw, iteration: int,
                   weights: Optional[torch.Tensor] = None) -> StepOutput:
        """Forward, backward and optimizer step over this rank's `rows` (its share of the global batch);
        `weights` ([rows, seq_length], from `loss_mask`): the loss is their weighted mean over the global batch."""
        raise NotImplementedError

    def validation_loss(self, valid_rows: np.ndarray, recurrences: Optional[int] = None,
                        record_stats: bool = False) -> tuple[float, list[dict[str, float]]]:
        """Mean loss per token over the validation windows (this rank takes its share; noise off), and
        with `record_stats` the recurrence diagnostics over all of them and all ranks (`_recording`)."""
        raise NotImplementedError

    def _recording(self, block, recurrences: Optional[int], record_stats: bool):
        """With `record_stats`: the recurrence diagnostics of every validation window `block` runs (None on
        a pipeline stage without the core), summed over all ranks when the context exits, so that every
        layout records the same numbers (model/diagnostics.py). Without: an empty list."""
        if not record_stats:
            return nullcontext([])
        steps = recurrences or self.engine.module.config.recurrences
        return recording_recurrence_stats(block, steps=steps, device=self.info.device,
                                          reduce=dist.all_reduce if self.info.world_size > 1 else None)

    def _to_device(self, rows) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(tokens, labels, document ids or None) on the device from rows of token ids (numpy, or a tensor
        pinned by the prefetcher: then the copy does not block the host). The document ids are computed
        on the device from the tokens (`data.reset_attention_mask`)."""
        t = torch.as_tensor(rows).to(self.info.device, non_blocking=True)
        tokens = t[:, :-1].contiguous()
        return tokens, t[:, 1:].contiguous(), document_ids_of(tokens, self.document_eos)


class PlainStepRunner(StepRunner):
    """One model replica per data-parallel rank (TP/SP inside the layers, ZeRO inside the engine)."""

    def __init__(self, parallel: ParallelModel, cfg: RunConfig, info: DistributedInfo, spikes: LossSpikeDetector,
                 loss_mask=None, document_eos=None, step_guard: Optional[NonFiniteStepGuard] = None):
        super().__init__(parallel, cfg, info, spikes, loss_mask, document_eos)
        self.clips_here = parallel.clips_outside_deepspeed
        self.step_guard = step_guard
        """The bare optimizer's skip guard (`install_step_guard`), handed the norm measured here."""

    def train_step(self, rows, seeds, draw, iteration, weights=None):
        total = device_zeros(dtype=torch.float32)
        grad_norm, reason, mean_loss = None, None, None
        injected = iteration + 1 in self.cfg.train.inject_nan_at
        if weights is not None:
            weights = weights.to(self.info.device, non_blocking=True)
            # Each micro-batch's weighted sum over the global batch's weight: DeepSpeed averages the
            # micro-batches and the DP ranks, so the gradient is the global weighted mean's in every layout.
            counted = weights.sum().reshape(1)
            if self.info.dp_size > 1:
                dist.all_reduce(counted, group=parallel_state.get_data_parallel_group())
            scale = self.accumulation * self.info.dp_size / counted.clamp(min=1.0)
        for index, start in enumerate(range(0, self.micro_batch * self.accumulation, self.micro_batch)):
            tokens, labels, documents = self._to_device(rows[start : start + self.micro_batch])
            per_token = self.engine(tokens, labels, draw.recurrences, draw.grad_recurrences,
                                    seeds[start : start + self.micro_batch], document_ids=documents)
            if weights is None:
                loss = per_token.mean()
            else:
                loss = (per_token * weights[start : start + self.micro_batch]).sum() * scale[0]
            total += loss.detach().float()
            if index == self.accumulation - 1:
                # The step's loss decides before the last backward whether the step is skipped: a step to
                # skip gets non-finite gradients, which every layout's optimizer path then drops
                # (step_guard.py). Only skipping spikes needs the loss on the host (its history) here; a
                # non-finite loss poisons the gradients on the device, without waiting for it.
                mean = self._dp_mean(total / self.accumulation)
                if self.cfg.train.skip_loss_spikes:
                    mean_loss = float(mean)
                    reason = self.spikes.check(mean_loss)
                if injected or reason is not None:
                    loss = loss * float("nan")
                elif mean_loss is None:
                    loss = loss * torch.where(torch.isfinite(mean), 1.0, float("nan"))  # x · 1 = x exactly
            self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary():
                # The host reads the step's numbers here, before the optimizer step is queued: the optimizer
                # then runs on the device while the host prepares the next step (read after it, the host
                # would wait for the whole step and the device would idle through that preparation).
                if self.clips_here:
                    # Measured and applied on the device (max_norm inf: measured, the gradients left as
                    # they are); its one read is the skip decision's, handed to the guard.
                    grad_norm = float(clip_grad_norm(self.engine.module.parameters(),
                                                     self.cfg.train.grad_clip or math.inf,
                                                     parallel_state.get_tensor_model_parallel_group(),
                                                     parallel_state.get_tensor_model_parallel_rank()))
                    if self.step_guard is not None:
                        self.step_guard.use_grad_norm(grad_norm)
                if mean_loss is None:  # ready with the norm: no second wait (tests/test_mixed_precision.py)
                    mean_loss = float(mean)
                    reason = self.spikes.check(mean_loss)
            self.engine.step()
        if injected:
            reason = "injected NaN (train.inject_nan_at)"
        return StepOutput(mean_loss, grad_norm, reason)

    @torch.no_grad()
    def validation_loss(self, valid_rows, recurrences=None, record_stats=False):
        # Data-parallel ranks share the windows and sum their losses: the result does not depend on the layout.
        self.engine.eval()
        mine = valid_rows[self.info.dp_rank :: self.info.dp_size]
        loss_sum, counted = device_zeros(dtype=torch.float64), 0  # loss summed over tokens, tokens
        with self._recording(self.engine.module.block, recurrences, record_stats) as stats:
            for start in range(0, len(mine), self.micro_batch):
                tokens, labels, documents = self._to_device(mine[start : start + self.micro_batch])
                loss = self.engine(tokens, labels, recurrences, document_ids=documents)
                if self.loss_mask is None:
                    loss_sum += loss.double().sum()
                    counted += loss.numel()
                else:
                    weights = self.loss_mask(np.asarray(mine[start : start + self.micro_batch]))
                    loss_sum += (loss.double() * device_tensor(weights, dtype=torch.float64)).sum()
                    counted += float(weights.sum())
        self.engine.train()
        sums = torch.stack([loss_sum, device_tensor(float(counted), dtype=torch.float64)])
        if self.info.dp_size > 1:
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        return float(sums[0] / sums[1]), stats

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over data-parallel ranks, on the device (nothing waits for it)."""
        value = value.detach().float().clone()
        if self.info.dp_size > 1:
            dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
            value /= self.info.dp_size
        return value


class PipelinedStepRunner(StepRunner):
    """DeepSpeed's pipeline engine: whole micro-batches flow through the stages; it reports the mean loss
    after the step (so a non-finite one is known only then). The recurrence diagnostics come from the stage
    that holds the core (a dense model split into layers has none)."""

    def __init__(self, parallel: ParallelModel, cfg: RunConfig, info: DistributedInfo, spikes: LossSpikeDetector,
                 valid_samples: int, document_eos: Optional[int] = None):
        super().__init__(parallel, cfg, info, spikes, document_eos=document_eos)
        # Evaluation uses the largest share of the validation set that is whole micro-batches on every DP
        # rank, checked now rather than at the first evaluation.
        self.eval_rows_per_rank = valid_samples // (info.dp_size * self.micro_batch) * self.micro_batch
        if self.eval_rows_per_rank == 0:
            raise DataError(f"the validation set ({valid_samples} samples) is smaller than one micro-batch per "
                            "data-parallel rank")

    def train_step(self, rows, seeds, draw, iteration, weights=None):
        assert weights is None, "data.loss_on=answers is refused with parallel.pp > 1 (config.py)"
        batches = self._micro_batches(rows, seeds, (draw.recurrences, draw.grad_recurrences))
        loss = float(self.engine.train_batch(data_iter=iter(batches)))  # mean over micro-batches and DP
        return StepOutput(loss, None, self.spikes.check(loss))  # a non-finite loss is logged and counted

    def validation_loss(self, valid_rows, recurrences=None, record_stats=False):
        per_rank = self.eval_rows_per_rank
        mine = valid_rows[self.info.dp_rank * per_rank : (self.info.dp_rank + 1) * per_rank]
        r = recurrences or self.engine.module.config.recurrences
        batches = self._micro_batches(mine, [0] * len(mine), (r, r))
        core = next((unit.block for unit in self.engine.module.modules()
                     if isinstance(unit, PipelineUnit) and unit.unit == "core"), None)
        with self._recording(core, r, record_stats) as stats:
            loss = self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))  # eval mode: no noise
        return float(loss), stats

    def _micro_batches(self, rows, seeds: Sequence[int], depth: tuple[int, int]) -> list:
        """((tokens, noise seeds, depth[, document ids]), labels) per micro-batch: what DeepSpeed's pipeline
        engine feeds its first stage (the rest travels with the activations) and its last stage (labels)."""
        out = []
        for start in range(0, len(rows), self.micro_batch):
            tokens, labels, documents = self._to_device(rows[start : start + self.micro_batch])
            # They travel between stages with the activations: on the device (NCCL's send/recv).
            extras = (device_tensor(seeds[start : start + self.micro_batch], dtype=torch.int64),
                      device_tensor(depth, dtype=torch.int64))
            if documents is not None:
                extras += (documents,)
            out.append(((tokens, *extras), labels))
        return out


def build_step_runner(parallel: ParallelModel, cfg: RunConfig, info: DistributedInfo, spikes: LossSpikeDetector,
                      valid_samples: int, loss_mask=None, document_eos: Optional[int] = None,
                      step_guard: Optional[NonFiniteStepGuard] = None) -> StepRunner:
    if parallel.pipelined:
        return PipelinedStepRunner(parallel, cfg, info, spikes, valid_samples, document_eos)
    return PlainStepRunner(parallel, cfg, info, spikes, loss_mask, document_eos, step_guard)
