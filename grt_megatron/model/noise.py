"""The recurrence's training noise (eps_x on the state, eps_g on the gate logits, and the random initial
state), keyed by sample so that every parallel layout, checkpoint recompute and resume draws the same."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from megatron.core import parallel_state

from grt_megatron.model.config import GRTConfig

NOISE_STATE, NOISE_GATE, NOISE_INITIAL_STATE = 0, 1, 2
"""The `kind` of a draw: each has its own stream per (sample, step)."""


def sequence_shard(config: GRTConfig) -> tuple[int, int]:
    """(shards, index) of this rank's slice of the sequence: (TP size, TP rank) under SP, else (1, 0)."""
    if not config.sequence_parallel:
        return 1, 0
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def draw_noise(like: torch.Tensor, sigma: float, per_token: bool, seeds: Optional[Sequence[int]],
               step: int, kind: int, shard: tuple[int, int] = (1, 0)) -> torch.Tensor:
    """N(0, sigma²) noise shaped like `like` ([s, b, d]; [s, b, 1] per token).

    With `seeds`, sample i's noise at (step, kind) comes from its own generator, so a sample gets the
    same noise in every parallel layout, in a checkpoint recompute and after a resume. Under sequence
    parallelism `like` is this rank's slice (`shard` = (shards, index)) of the sequence: the sample's
    full-length noise is drawn and the slice kept. Without seeds (direct model calls) it comes from the
    global RNG.
    """
    s, b, d = like.shape
    width = 1 if per_token else d
    if seeds is None:
        return torch.randn((s, b, width), dtype=like.dtype, device=like.device) * sigma
    if len(seeds) != b:
        raise ValueError(f"{len(seeds)} noise seeds for a batch of {b}")
    shards, index = shard
    # Each sample's stream is drawn into one reused buffer (as torch.randn would draw it) and scaled straight
    # into its column of the result: no per-sample tensors, stack or separate multiply (noise is a few
    # percent of a small GRT's CPU step, tools/bench/overhead.py). Scaling inside the draw (normal_(0, σ))
    # would save the multiply, but below 16 elements torch scales in double precision and the bits change.
    full = torch.empty((s * shards, width), dtype=torch.float32, device=like.device)
    noise = torch.empty((s, b, width), dtype=torch.float32, device=like.device)
    for i, seed in enumerate(seeds):
        full.normal_(generator=sample_generator(int(seed), step, kind, like.device))
        torch.mul(full[s * index : s * (index + 1)], sigma, out=noise[:, i])
    return noise.to(like.dtype)


def sample_generator(seed: int, step: int, kind: int, device: torch.device) -> torch.Generator:
    """The generator of one sample's draw of `kind` at recurrence `step`: seeded from (seed, step, kind)
    mixed through numpy's SeedSequence, so nearby seeds and steps give unrelated streams."""
    mixed = np.random.SeedSequence([seed, step, kind]).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(mixed) & (2**63 - 1))


def recurrence_noise(config: GRTConfig, training: bool, like: torch.Tensor, seeds: Optional[Sequence[int]],
                     step: int, kind: int) -> Optional[torch.Tensor]:
    """eps_x (`NOISE_STATE`) or eps_g (`NOISE_GATE`) of recurrence `step`; None outside training or at σ = 0."""
    if not (training and config.noise_sigma > 0):
        return None
    return draw_noise(like, config.noise_sigma, config.noise_shape == "per_token", seeds, step, kind,
                      sequence_shard(config))


def random_initial_state(config: GRTConfig, training: bool, h_pre: torch.Tensor,
                         seeds: Optional[Sequence[int]]) -> torch.Tensor:
    """h_0 ~ N(0, initial_state_std²) (`initial_state: random`): per sample in training; outside training
    one fixed draw, so that evaluation and generation are deterministic and independent of the global RNG."""
    std, shard = config.initial_state_std, sequence_shard(config)
    if training:
        return draw_noise(h_pre, std, False, seeds, 0, NOISE_INITIAL_STATE, shard)
    s, b, d = h_pre.shape
    generator = torch.Generator(device=h_pre.device).manual_seed(0)
    full = torch.randn((s * shard[0], b, d), generator=generator, device=h_pre.device)
    return full[s * shard[1] : s * (shard[1] + 1)].to(h_pre.dtype) * std
