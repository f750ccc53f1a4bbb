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

from grt_megatron.device import device_tensor, device_zeros


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


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, tp_group=None,
                   tp_rank: int = 0) -> torch.Tensor:
    """The global L2 norm of the gradients (a 0-d fp32 tensor on their device), and with a finite
    `max_norm` the gradients scaled by min(1, max_norm / (norm + 1e-6)), as DeepSpeed's and Megatron-LM's
    clipping. Nothing waits for the device: the norm comes from one `_foreach_norm` (a few kernels on a
    GPU, where a per-parameter loop launches one per parameter), the scale is applied whatever it is
    (× 1 is exact) instead of being compared on the host. Under tensor parallelism the parameters that
    are replicated over the TP group count once (TP rank 0's) and the sum of squares is all-reduced over
    `tp_group`; data-parallel ranks hold the same reduced gradients, so they need no reduction."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    grads, counted = [], []
    for p in parameters:
        if p.grad is not None:
            grads.append(p.grad)
            if tp_rank == 0 or is_model_parallel_parameter(p):
                counted.append(p.grad.detach())
    if counted:
        total = torch.stack([n.float() for n in torch._foreach_norm(counted)]).pow(2).sum()
    else:
        total = device_zeros(dtype=torch.float32).reshape(())
    if tp_group is not None and dist.get_world_size(group=tp_group) > 1:
        dist.all_reduce(total, group=tp_group)
    norm = total.sqrt()
    if grads and math.isfinite(max_norm):
        # A tensor over a tensor: a Python float over one is computed as a reciprocal times it (other bits).
        torch._foreach_mul_(grads, (torch.full_like(norm, max_norm) / (norm + 1e-6)).clamp(max=1.0))
    return norm


class NonFiniteStepGuard:
    """Makes a bare optimizer skip steps with non-finite gradients, the way DeepSpeed's wrappers do: its
    `step` is wrapped on the instance, and `overflow` is set so that DeepSpeed's engine counts the step
    as skipped and does not advance the LR schedule.

    When the trainer has measured and read the step's global grad norm (`clip_grad_norm`, the same on
    every rank), `use_grad_norm` hands it over and the guard decides from it with no read of its own (a
    norm is finite exactly when every gradient is, up to an overflow of the sum, which is then skipped
    too); else it computes the flag itself, over every rank, and reads it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.grad_norm: Optional[float] = None
        optimizer.overflow = False
        inner = optimizer.step

        def step(closure=None):
            if self.grad_norm is not None:
                optimizer.overflow = not math.isfinite(self.grad_norm)
                self.grad_norm = None
            else:
                grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
                optimizer.overflow = _any_nonfinite(grads)
            if optimizer.overflow:
                optimizer._opt_called = True  # what torch's LR scheduler checks to know step() was called
                return None
            return inner() if closure is None else inner(closure)

        # torch's LR scheduler marks the step it wrapped; keep the mark so it does not warn of an override.
        step._wrapped_by_lr_sched = getattr(inner, "_wrapped_by_lr_sched", None)
        optimizer.step = step

    def use_grad_norm(self, norm: float) -> None:
        """The global gradient norm of the step about to be taken, read by the trainer (used at this
        `step`, then forgotten)."""
        self.grad_norm = norm


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
