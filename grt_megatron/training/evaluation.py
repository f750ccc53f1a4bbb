"""Validation during training: the loss at the configured R with the recurrence diagnostics, MoR's other
routing rule, Ouro's exit rule, the depth probe (probe.py), and the depth sweep at the end. Each writes its records to metrics.jsonl."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from grt_megatron.model import GRTConfig, forward_flops_per_token
from grt_megatron.model.ouro import ExitStats, recording_exit_stats
from grt_megatron.training.metrics import MetricsLogger
from grt_megatron.training.probe import DepthProbe
from grt_megatron.training.step_runner import StepRunner


class Evaluator:
    def __init__(self, runner: StepRunner, model_config: GRTConfig, valid_rows: np.ndarray, logger: MetricsLogger,
                 seq_length: int, progress: bool, probe: Optional[DepthProbe] = None):
        self.runner, self.model_config, self.valid_rows = runner, model_config, valid_rows
        self.logger, self.seq_length, self.progress = logger, seq_length, progress
        self.probe = probe

    def probe_metrics(self, recurrences: Optional[int] = None) -> dict[str, float]:
        """The depth probe's metrics (probe.py) at `recurrences`; empty without a probe."""
        return self.probe.evaluate(self.runner, recurrences) if self.probe is not None else {}

    def validate(self, step: int) -> float:
        """Validation loss at the configured R, logged (`split: valid`) with, per recurrence, the mean gate
        and ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ over all validation windows (does the gate learn, does the state
        still move; model/diagnostics.py), the same numbers in every layout."""
        loss, stats = self.runner.validation_loss(self.valid_rows, record_stats=True)
        gates = {f"{key}_r{r + 1}": value for r, step_stats in enumerate(stats)
                 for key, value in step_stats.items() if value == value}  # NaN: no gate in this model
        self.logger.log({"step": step, "split": "valid", "loss": loss, "perplexity": float(np.exp(min(loss, 50.0))),
                         "recurrences": self.model_config.recurrences, **gates, **self.other_mor_routing(),
                         **self.exit_rule(), **self.probe_metrics()})
        return loss

    def other_mor_routing(self) -> dict[str, float]:
        """MoR: the validation loss under the evaluation routing the run does not report as `loss`
        (`loss_topk_routing` or `loss_threshold_routing`), so both the causal and the training rule are
        on record. Empty for every other model."""
        if self.model_config.routing == "none":
            return {}
        block = self.runner.engine.module.block
        other = "topk" if self.model_config.mor_eval_routing == "threshold" else "threshold"
        block.mor_eval_routing = other
        try:
            return {f"loss_{other}_routing": self.runner.validation_loss(self.valid_rows)[0]}
        finally:
            block.mor_eval_routing = self.model_config.mor_eval_routing

    def exit_rule(self) -> dict[str, float]:
        """Ouro: the validation loss under the exit rule (`loss_exit_rule`: each token scored at the first
        step where its cumulative exit probability reaches `exit_threshold`; `loss` is the last step) and
        the exit statistics over all validation tokens (`ouro.ExitStats.metrics`). Empty for other models."""
        if not self.model_config.exit_head:
            return {}
        info = self.runner.info
        with recording_exit_stats(self.runner.engine.module, info.device) as stats:
            loss = self.runner.validation_loss(self.valid_rows)[0]
        summed = stats.as_tensor()
        if info.dp_size > 1:
            dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
        return {"loss_exit_rule": loss, **ExitStats.metrics(summed, self.model_config.recurrences)}

    def depth_sweep(self, step: int, extra: int, is_main: bool) -> None:
        """Validation loss at R = 1 … R + `extra`: how the model behaves when run with fewer or more
        recurrences than it was evaluated at (one `split: depth_sweep` record per R)."""
        cfg = self.model_config
        if cfg.is_dense:
            return
        # MoR has one router per trained recursion: it cannot run deeper than it was trained.
        top = cfg.recurrences if cfg.routing != "none" else cfg.recurrences + extra
        for r in tqdm(range(1, top + 1), desc="depth sweep", unit="R", dynamic_ncols=True,
                      disable=not (is_main and self.progress)):
            loss = self.runner.validation_loss(self.valid_rows, recurrences=r)[0]
            self.logger.log({"step": step, "split": "depth_sweep", "recurrences": r, "loss": loss,
                             "flops_per_token": forward_flops_per_token(cfg, self.seq_length, r)["total"],
                             **self.probe_metrics(r)})
        if is_main:
            print(f"depth sweep: validation loss at R = 1 … {top} logged to metrics.jsonl", flush=True)
