"""How many recurrences a training step runs, drawn identically on every rank.

Each draw is a pure function of (seed, iteration): ranks never exchange R, a rank that drew a different
R would deadlock the collectives, and a resumed run draws the same sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from grt_megatron.model.config import DEPTH_SAMPLERS, ConfigError, GRTConfig

_STREAM = 0x6472  # separates this stream from other (seed, iteration) draws


@dataclass(frozen=True)
class DepthDraw:
    recurrences: int
    """Core steps executed this iteration."""
    grad_recurrences: int
    """How many of the last steps carry gradient (truncated backprop); the rest run under no_grad."""

    @property
    def no_grad_recurrences(self) -> int:
        return self.recurrences - self.grad_recurrences


class DepthSampler:
    """`fixed`: R. `uniform`: U{1..R}. `heavy_tail`: Poisson(LogNormal(log R - s²/2, s)) + 1 with
    gradient through the last k steps only."""

    def __init__(self, kind: str, recurrences: int, seed: int, sigma: float = 0.5, k: int = 8):
        if kind not in DEPTH_SAMPLERS:
            raise ConfigError(f"model.depth_sampler={kind!r} is not one of {', '.join(DEPTH_SAMPLERS)}")
        self.kind, self.recurrences, self.seed, self.sigma, self.k = kind, recurrences, seed, sigma, k

    @classmethod
    def from_config(cls, config: GRTConfig, seed: int) -> "DepthSampler":
        return cls(config.depth_sampler, config.recurrences, seed, config.heavy_tail_sigma, config.heavy_tail_k)

    def draw(self, iteration: int) -> DepthDraw:
        if self.kind == "fixed":
            return DepthDraw(self.recurrences, self.recurrences)
        rng = np.random.default_rng([self.seed, iteration, _STREAM])
        if self.kind == "uniform":
            r = int(rng.integers(1, self.recurrences + 1))
            return DepthDraw(r, r)
        rate = rng.lognormal(mean=math.log(self.recurrences) - self.sigma**2 / 2, sigma=self.sigma)
        r = int(rng.poisson(rate)) + 1
        return DepthDraw(r, min(r, self.k))
