"""Recurrence diagnostics, attached from outside the model as a step hook: per recurrence step, the mean
gate value and the relative state update ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ (does the gate learn, does the state
still move), and for MoR the fraction of positions still recurring. The trainer records them over every
validation window (`gate_mean_rN`, `relative_update_rN`, `active_fraction_rN` in metrics.jsonl).

Each statistic is kept as sums on the device (squared norms, gate values and their count, positions), added
up over every forward the block runs while recording and, in a parallel run, over the ranks: DP ranks hold
other windows, SP ranks other parts of each sequence, and pipeline stages without the core hold nothing.
The ratios are taken once, at the end, so they do not depend on the layout, the micro-batch size or which
rank logs (TP ranks without SP hold the same tensors; summed, numerator and denominator both scale by TP).
No host wait until then.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

# One row per recurrence step: the columns summed.
COLUMNS = ("calls", "update_sq", "state_sq", "gate_sum", "gate_count", "active", "positions")


class RecurrenceStatsSums:
    """The sums behind the diagnostics, per recurrence step ([steps, COLUMNS], float64, on the device)."""

    def __init__(self, steps: int, device: torch.device):
        self.table = torch.zeros(steps, len(COLUMNS), dtype=torch.float64, device=device)

    @torch.no_grad()
    def record(self, h: torch.Tensor, h_new: torch.Tensor, g, step: int,
               active: Optional[torch.Tensor] = None, positions: int = 0) -> None:
        """A hook's call for recurrence `step`: g a tensor, a float (the fixed gate) or None (no gate);
        MoR passes the positions still recurring (`active`, a count) of all `positions`."""
        if step >= self.table.shape[0]:  # more steps than expected (a deeper run): grow
            grown = torch.zeros(step + 1, len(COLUMNS), dtype=torch.float64, device=self.table.device)
            grown[: self.table.shape[0]] = self.table
            self.table = grown
        f64 = torch.float64
        zero = torch.zeros((), dtype=f64, device=h.device)
        if g is None:
            gate_sum, gate_count = zero, 0
        elif isinstance(g, float):
            gate_sum, gate_count = zero + g * h.numel(), h.numel()
        else:
            gate_sum, gate_count = g.sum(dtype=f64), g.numel()
        row = torch.stack([
            zero + 1,
            torch.linalg.vector_norm(h_new - h, dtype=f64).square(),
            torch.linalg.vector_norm(h, dtype=f64).square(),
            gate_sum,
            zero + gate_count,
            zero if active is None else active.to(f64),
            zero + positions,
        ])
        self.table[step] += row.to(self.table.device)

    @staticmethod
    def as_dicts(table: torch.Tensor) -> list[dict[str, float]]:
        """One dict per recorded step (trailing steps no forward reached are dropped: MoR stops when every
        token has left): `gate_mean` (NaN without a gate), `relative_update`, and MoR's `active_fraction`."""
        rows = [dict(zip(COLUMNS, values)) for values in table.tolist()]
        while rows and rows[-1]["calls"] == 0:
            rows.pop()
        out = []
        for row in rows:
            stats = {"gate_mean": row["gate_sum"] / row["gate_count"] if row["gate_count"] else math.nan,
                     "relative_update": math.sqrt(row["update_sq"]) / max(math.sqrt(row["state_sq"]), 1e-12)}
            if row["positions"]:
                stats["active_fraction"] = row["active"] / row["positions"]
            out.append(stats)
        return out


@contextmanager
def recording_recurrence_stats(block, steps: int = 0, device: Optional[torch.device] = None,
                               reduce: Optional[Callable[[torch.Tensor], None]] = None
                               ) -> Iterator[list[dict[str, float]]]:
    """Within: record every recurrence step `block` runs (None: a pipeline stage without the core, which
    contributes nothing but still takes part in `reduce`). On leaving, `reduce` (an in-place all-reduce
    over the ranks, or None) is applied to the sums, and the yielded list gets one dict per step
    (`RecurrenceStatsSums.as_dicts`). `steps` and `device` size the table up front, for ranks that must
    reduce a table of the same shape whether or not they ran the block."""
    if device is None:
        device = next(block.parameters()).device if block is not None else torch.device("cpu")
    sums = RecurrenceStatsSums(steps, device)
    stats: list[dict[str, float]] = []
    handle = block.register_step_hook(sums.record) if block is not None else None
    try:
        yield stats
    finally:
        if handle is not None:
            handle.remove()
    if reduce is not None:
        reduce(sums.table)
    stats.extend(RecurrenceStatsSums.as_dicts(sums.table))
