"""Non-finite and spiking steps: skipped, counted, and never written into a checkpoint.

The policy, as in the large frameworks (Megatron-LM's overflow skip, OLMo-core's skip-step optimizer):

- An optimizer step whose global gradient norm is not finite is skipped: no change to the weights or
  the Adam moments, the LR schedule does not advance (DeepSpeed's skipped-step semantics), and the step
  is logged with `skipped: true`. DeepSpeed's ZeRO / bf16 optimizer wrappers detect this themselves;
  where DeepSpeed hands our optimizer the gradients directly (fp32 or bf16 without ZeRO),
  `NonFiniteStepGuard` does the same check, over every rank.
- A non-finite training loss, or with `train.skip_loss_spikes` a loss above `train.loss_spike_factor`
  × the median of the last `train.loss_spike_window` losses, is known after the last micro-batch's
  forward and before its backward: the trainer multiplies that micro-batch's loss by NaN, so the
  gradients are non-finite and the step is skipped by the same path (one mechanism for every layout).
- More than `train.max_skipped_steps` skipped steps in a row stop the run (`TrainingDiverged`, exit 3).
- Before a checkpoint is written every rank checks its weights: a non-finite one stops the run instead
  of being saved, so pruning can never replace the last good checkpoint with a bad one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from grt_megatron.device import device_tensor


class TrainingDiverged(Exception):
    """Training cannot go on: too many non-finite steps in a row, or non-finite weights at a save."""


def _any_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if any tensor on any rank holds inf/NaN (one small all-reduce; every rank must call it)."""
    tensors = [t.detach() for t in tensors if t is not None and t.numel()]
    local = torch.stack([n.float() for n in torch._foreach_norm(tensors)]).sum() if tensors else None
    flag = device_tensor([0 if local is None or bool(torch.isfinite(local)) else 1], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class NonFiniteStepGuard:
    """Makes a bare optimizer skip steps with non-finite gradients, the way DeepSpeed's wrappers do: its
    `step` is wrapped on the instance, and `overflow` is set so that DeepSpeed's engine counts the step
    as skipped and does not advance the LR schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        optimizer.overflow = False
        inner = optimizer.step

        def step(closure=None):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            optimizer.overflow = _any_nonfinite(grads)
            if optimizer.overflow:
                optimizer._opt_called = True  # what torch's LR scheduler checks to know step() was called
                return None
            return inner() if closure is None else inner(closure)

        # torch's LR scheduler marks the step it wrapped; keep the mark so it does not warn of an override.
        step._wrapped_by_lr_sched = getattr(inner, "_wrapped_by_lr_sched", None)
        optimizer.step = step


def install_step_guard(engine) -> Optional[NonFiniteStepGuard]:
    """Guard the optimizer when DeepSpeed steps it directly (no wrapper of its own that checks)."""
    if engine.optimizer is engine.basic_optimizer:
        return NonFiniteStepGuard(engine.basic_optimizer)
    return None


# Where each DeepSpeed optimizer wrapper keeps this rank's fp32 master weights (ZeRO 3 steps its inner
# optimizer one sub-group at a time and leaves the inner param groups empty in between).
_MASTER_WEIGHTS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def master_weights(engine) -> list[torch.Tensor]:
    """This rank's fp32 master weights, in whatever form the engine's optimizer holds them."""
    for name in _MASTER_WEIGHTS:
        tensors = getattr(engine.optimizer, name, None)
        if tensors:
            return [t for t in tensors if t is not None]
    return [p for group in engine.basic_optimizer.param_groups for p in group["params"]]


def weights_are_finite(engine) -> bool:
    """Every rank checks the weights it owns (for ZeRO, its partition of the fp32 master weights)."""
    return not _any_nonfinite(master_weights(engine))


class LossSpikeDetector:
    """A loss above `factor` × the median of the last `window` finite, non-spike losses is a spike. The
    window is part of the run's state (saved in checkpoints), so a resumed run decides as the original."""

    MIN_HISTORY = 10

    def __init__(self, factor: Optional[float], window: int, history: Iterable[float] = ()):
        self.factor = factor
        self.history: deque = deque(history, maxlen=window)

    def check(self, loss: float) -> Optional[str]:
        """'non-finite loss', 'loss spike' or None; a normal loss joins the window."""
        if not math.isfinite(loss):
            return "non-finite loss"
        if self.factor is not None and len(self.history) >= self.MIN_HISTORY:
            median = statistics.median(self.history)
            if loss > self.factor * median:
                return "loss spike"
        self.history.append(loss)
        return None
