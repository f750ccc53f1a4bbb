"""Depth samplers: identical draws on independent instances (ranks), the right distributions."""

import numpy as np
import pytest

from grt_megatron.model import ConfigError, DepthSampler


@pytest.mark.parametrize("kind", ["fixed", "uniform", "heavy_tail"])
def test_independent_samplers_draw_the_same_r(kind):
    # Two ranks build their own sampler; neither communicates, both must agree at every iteration.
    rank0, rank1 = DepthSampler(kind, 6, seed=42), DepthSampler(kind, 6, seed=42)
    order = list(range(500))
    draws0 = [rank0.draw(i) for i in order]
    draws1 = [rank1.draw(i) for i in reversed(order)][::-1]  # order of asking does not matter
    assert draws0 == draws1
    other_seed = [DepthSampler(kind, 6, seed=43).draw(i) for i in order]
    if kind != "fixed":
        assert other_seed != draws0


def test_uniform_covers_1_to_r():
    draws = [DepthSampler("uniform", 4, seed=0).draw(i).recurrences for i in range(4000)]
    counts = np.bincount(draws, minlength=5)
    assert counts[0] == 0 and min(counts[1:]) > 900
    assert all(d.recurrences == d.grad_recurrences for d in (DepthSampler("uniform", 4, 0).draw(i) for i in range(50)))


def test_fixed_is_r():
    assert {DepthSampler("fixed", 7, seed=0).draw(i).recurrences for i in range(20)} == {7}


def test_heavy_tail_distribution_and_truncation():
    sampler = DepthSampler("heavy_tail", 6, seed=1, sigma=0.5, k=8)
    draws = [sampler.draw(i) for i in range(20000)]
    r = np.array([d.recurrences for d in draws])
    # rate ~ LogNormal with mean R, R_step = Poisson(rate) + 1: mean R + 1, a long right tail.
    assert r.mean() == pytest.approx(7.0, abs=0.1)
    assert r.min() >= 1 and np.percentile(r, 99) > 2 * 6
    for d in draws:
        assert d.grad_recurrences == min(d.recurrences, 8)
        assert d.no_grad_recurrences == max(d.recurrences - 8, 0)


def test_unknown_sampler_is_named():
    with pytest.raises(ConfigError, match="model.depth_sampler='poisson'"):
        DepthSampler("poisson", 4, seed=0)
