"""Baselines and ablations as configurations of the one model: forward/backward, parameter counts, and
the update rule each one promises."""

import math

import pytest
import torch
from conftest import REPO, tiny_config
from hydra import compose, initialize_config_dir

from grt_megatron.model import GRTLanguageModel, count_parameters
from grt_megatron.model.config import mor_capacity
from grt_megatron.model.diagnostics import recording_recurrence_stats
from grt_megatron.model.layers import StepInputs, run_layers
from grt_megatron.model.mor import run_mor


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
    inputs = StepInputs(None)
    with torch.no_grad():
        o = run_layers(block.core, block._inject(h, h_pre), inputs)
        got = block.recurrence_step(h, h_pre, inputs, step=0)
    g = torch.sigmoid(torch.tensor(config.gate_bias_init / config.gate_temperature))
    want = h + o if gate == "residual" else g * h + (1 - g) * o
    assert torch.allclose(got, want, atol=1e-6)
    with torch.no_grad(), recording_recurrence_stats(block) as stats:
        block.recurrence_step(h, h_pre, inputs, step=0)
    if gate == "fixed":
        assert stats[0]["gate_mean"] == pytest.approx(0.982, abs=1e-3)  # sigmoid(4), every step
    _forward_backward(GRTLanguageModel(config).train(), config.vocab_size)


def test_gate_ablations_are_refused_by_the_hf_export():
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import hf_config_kwargs

    with pytest.raises(CheckpointError, match="model.gate='residual'"):
        hf_config_kwargs({**tiny_config(gate="residual").to_dict()})


# ---- Mixture-of-Recursions ----------------------------------------------------------------------------------
MOR = dict(gate="none", injection="none", noise_sigma=0.0, depth_sampler="fixed", routing="expert_choice")


def test_mor_router_capacity_shrinks_with_depth_and_leavers_skip_later_recursions(world):
    config = tiny_config(**MOR, recurrences=4)
    model = GRTLanguageModel(config).eval()
    block, s, d = model.block, 16, config.hidden_size
    block.mor_eval_routing = "topk"  # the training rule, without training's router loss
    core_tokens, router_tokens = [], []
    block.core[0].register_forward_pre_hook(lambda m, args: core_tokens.append(args[0].shape[0]))
    for router in block.routers:
        router.register_forward_pre_hook(lambda m, args: router_tokens.append(args[0].shape[0]))
    h = torch.randn(s, 3, d, generator=torch.Generator().manual_seed(0))
    inputs = StepInputs(None)
    with torch.no_grad():
        outs = [run_mor(block, h, inputs, r) for r in range(1, 5)]
    # Capacities ceil(S·(R−r+1)/R) = 16, 12, 8, 4; each router sees the previous recursion's tokens.
    assert core_tokens == [16, 16, 12, 16, 12, 8, 16, 12, 8, 4]
    assert router_tokens == [16, 16, 16, 16, 16, 12, 16, 16, 12, 8]
    assert [mor_capacity(s, 4, r) for r in range(4)] == [16, 12, 8, 4]
    # Running one more recursion changes exactly that recursion's tokens, and only tokens that were
    # still active: a token that left never changes again.
    moved_before = torch.ones(s, 3, dtype=torch.bool)
    for r in range(1, 4):
        moved = (outs[r] != outs[r - 1]).any(-1)
        assert (moved.sum(0) == mor_capacity(s, 4, r)).all()
        assert not (moved & ~moved_before).any()
        moved_before = moved


def test_mor_threshold_routing_is_causal_and_per_sequence(world):
    config = tiny_config(**MOR, recurrences=4)
    assert config.mor_eval_routing == "threshold"
    model = GRTLanguageModel(config, init_seed=1).eval()
    block, s = model.block, 16
    tokens = torch.randint(0, config.vocab_size, (4, s), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, s // 2 :] = torch.randint(0, config.vocab_size, (4, s - s // 2), generator=torch.Generator().manual_seed(3))

    def logits(batch, routing):
        block.mor_eval_routing = routing
        with torch.no_grad():
            return model(batch)

    # Threshold: a token's depth depends on itself and earlier tokens, so later tokens change nothing before
    # them (up to rounding: the compact sequences' lengths differ). Top-k (the training rule) compares
    # scores across the sequence: later tokens move earlier predictions.
    def moved_before_the_change(routing):
        return (logits(tokens, routing) - logits(changed, routing))[:, : s // 2].abs().max().item()

    assert moved_before_the_change("threshold") < 1e-5
    assert moved_before_the_change("topk") > 1e-2

    # Sequences keep different numbers of tokens (their compact columns are padded): each sequence of
    # the batch gets exactly what it gets alone, and the tokens that move at recursion r are those whose
    # router says > 0.5 among the tokens that moved at r - 1 (all of them at r = 1, where training keeps all).
    block.mor_eval_routing = "threshold"
    with torch.no_grad():
        h = model.embedding(input_ids=tokens, position_ids=torch.arange(s).expand(4, s))
        inputs = StepInputs(None)
        h = run_layers(block.prelude, h, inputs)
        outs = [run_mor(block, h, inputs, r) for r in range(5)]
        alone = [run_mor(block, h[:, i : i + 1], inputs, 4) for i in range(4)]
    assert torch.allclose(torch.cat(alone, dim=1), outs[4], atol=1e-6)
    active = torch.ones(s, 4, dtype=torch.bool)
    counts = []
    for r in range(4):
        with torch.no_grad():
            wants = block.routers[r](outs[r]).squeeze(-1) > 0 if r else torch.ones(s, 4, dtype=torch.bool)
        moved = (outs[r + 1] != outs[r]).any(-1)
        assert torch.equal(moved, active & wants)
        active = moved
        counts.append(active.sum(0).tolist())
    assert any(len(set(c)) > 1 for c in counts)  # the padding was exercised


def test_mor_trains_with_its_router_loss_and_counts_its_parameters(world):
    config = tiny_config(**MOR, recurrences=3)
    model = GRTLanguageModel(config)
    assert count_parameters(config)["routers"] == 3 * config.hidden_size
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
    _forward_backward(model.train(), config.vocab_size)
    assert model.block.aux_loss is not None and model.block.aux_loss.item() > 0
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in model.block.routers)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        train_loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        aux = model.block.aux_loss
        model.block.mor_eval_routing = "topk"  # the same routing as training, without the router loss
        eval_loss = model.eval()(tokens[:, :-1], tokens[:, 1:]).mean()
    # In training the mean loss carries the weighted router loss once; evaluation reports the LM loss only.
    assert train_loss.item() == pytest.approx(eval_loss.item() + config.router_aux_loss_coeff * aux.item(), rel=1e-5)


def test_mor_flops_count_the_tokens_that_stay():
    from grt_megatron.model import forward_flops_per_token
    from grt_megatron.model.flops import _layer_flops

    mor, grt = tiny_config(**MOR, recurrences=4), tiny_config(recurrences=4)
    s = 16
    layers = forward_flops_per_token(mor, s)["layers"]
    core = sum(_layer_flops(mor, k) * k / s for k in (16, 12, 8, 4))
    assert layers == 2 * _layer_flops(mor, s) + round(core)
    assert layers < forward_flops_per_token(grt, s)["layers"]


def test_mor_refuses_what_it_does_not_support():
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import hf_config_kwargs
    from grt_megatron.model import ConfigError, GRTConfig
    from grt_megatron.parallel import validate_layout

    with pytest.raises(ConfigError, match="needs model.gate='none'"):
        tiny_config(**{**MOR, "gate": "mlp"})
    with pytest.raises(ConfigError, match="not supported with tensor or sequence parallelism"):
        GRTConfig.from_recipe(tiny_config(**MOR).to_dict(), tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match="not supported with parallel.pp=2"):
        validate_layout(world_size=2, tp=1, pp=2, sp=False, zero_stage=1, model={**MOR, "hidden_size": 64},
                        seq_length=16, micro_batch=1, global_batch=2)
    with pytest.raises(CheckpointError, match="Mixture-of-Recursions"):
        hf_config_kwargs(tiny_config(**MOR).to_dict())
