"""Recurrence diagnostics, attached from outside the model as a step hook: per recurrence step, the mean
gate value and the relative state update ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ (does the gate learn, does the state
still move). The trainer records them on the first validation micro-batch (`gate_mean_rN`,
`relative_update_rN` in metrics.jsonl)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def recording_recurrence_stats(block) -> Iterator[list[dict[str, float]]]:
    """Within the block: a list that gets one dict per recurrence step the block runs (`gate_mean` is NaN
    for a model without a gate; MoR adds `active_fraction`). A hook gets g as a tensor, a float (the fixed
    gate) or None."""
    stats: list[dict[str, float]] = []

    @torch.no_grad()
    def record(h: torch.Tensor, h_new: torch.Tensor, g, **extra: float) -> None:
        update = (h_new - h).float().norm() / h.float().norm().clamp_min(1e-12)
        gate_mean = float("nan") if g is None else float(g) if isinstance(g, float) else float(g.float().mean())
        stats.append({"gate_mean": gate_mean,
                      "relative_update": float(update), **extra})

    handle = block.register_step_hook(record)
    try:
        yield stats
    finally:
        handle.remove()
