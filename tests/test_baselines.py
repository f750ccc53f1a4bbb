"""Baselines and ablations as configurations of the one model: forward/backward, parameter counts, and
the update rule each one promises."""

import math

import pytest
import torch
from conftest import REPO, tiny_config
from hydra import compose, initialize_config_dir

from grt_megatron.model import GRTLanguageModel, count_parameters
from grt_megatron.model.language_model import causal_attention_mask
from grt_megatron.model.recurrent_block import StepInputs


def _forward_backward(model, vocab):
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:], noise_seeds=[0, 1]).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert math.isfinite(loss.item()) and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("recipe", ["tiny_heavy_tail", "tiny_shared"])
def test_baseline_recipes_build_train_and_count(world, recipe):
    from grt_megatron.training.config import build_run_config

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = build_run_config(compose("train", overrides=[f"model={recipe}", "run.dir=unused"]))
    config = cfg.model_config(300)
    model = GRTLanguageModel(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
    assert not any("gate" in n or "injection" in n for n, _ in model.named_parameters())  # no gate, no W_in
    _forward_backward(model, 300)


@pytest.mark.parametrize("gate", ["residual", "fixed"])
def test_no_gate_ablations_follow_their_update_rule(world, gate):
    config = tiny_config(gate=gate)
    model = GRTLanguageModel(config).eval()
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
    assert not any(n.startswith("block.gate") for n, _ in model.named_parameters())
    block = model.block
    s, d = 8, config.hidden_size
    h, h_pre = torch.randn(s, 2, d), torch.randn(s, 2, d)
    inputs = StepInputs(causal_attention_mask(s, h.device))
    with torch.no_grad():
        o = block._run(block.core, block._inject(h, h_pre), inputs)
        got = block.recurrence_step(h, h_pre, inputs, step=0)
    g = torch.sigmoid(torch.tensor(config.gate_bias_init / config.gate_temperature))
    want = h + o if gate == "residual" else g * h + (1 - g) * o
    assert torch.allclose(got, want, atol=1e-6)
    block.step_stats = []
    with torch.no_grad():
        block.recurrence_step(h, h_pre, inputs, step=0)
    if gate == "fixed":
        assert block.step_stats[0]["gate_mean"] == pytest.approx(0.982, abs=1e-3)  # sigmoid(4), every step
    _forward_backward(GRTLanguageModel(config).train(), config.vocab_size)


def test_gate_ablations_are_refused_by_the_hf_export():
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import hf_config_kwargs

    with pytest.raises(CheckpointError, match="model.gate='residual'"):
        hf_config_kwargs({**tiny_config(gate="residual").to_dict()})
