"""The GRT model: parameter counts, gate init, noise, dense equivalence, truncated backprop, checkpointing."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, tiny_config
from grt_megatron.model.diagnostics import recording_recurrence_stats
from grt_megatron.model.layers import StepInputs, run_layers
from grt_megatron.model.noise import draw_noise, recurrence_noise
from grt_megatron.model import (ConfigError, GRTConfig, GRTLanguageModel, count_parameters,
                                forward_flops_per_token, train_flops_per_token, DepthDraw)

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "model").glob("*.yaml"))


def recipe(name: str, vocab_size: int = 50257) -> GRTConfig:
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}"])
    model = OmegaConf.to_container(cfg.model)
    model["vocab_size"] = vocab_size
    return GRTConfig.from_recipe(model)


def build(cfg: GRTConfig, seed: int = 0) -> GRTLanguageModel:
    torch.manual_seed(seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return GRTLanguageModel(cfg, init_seed=seed)


def tokens(batch=2, seq=16, vocab=300, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parameter_count_equals_closed_form(world, name):
    cfg = recipe(name)
    with torch.device("meta"):  # the real modules, no memory: large recipes are 774 M parameters
        model = GRTLanguageModel(cfg)
    built = sum(p.numel() for p in model.parameters())
    assert built == count_parameters(cfg)["total"]


def test_paper_parameter_counts():
    # PAPER_NOTES: large isoFLOPs GRT ≈ 290 M vs dense ≈ 774 M ("63% fewer parameters").
    grt, dense = count_parameters(recipe("large_grt_isoflops"))["total"], count_parameters(recipe("large_dense"))["total"]
    assert round(grt / 1e6) == 290 and round(dense / 1e6) == 774
    assert round(100 * (1 - grt / dense)) in (62, 63)
    assert round(count_parameters(recipe("small_dense"))["total"] / 1e6) == 124  # GPT-2 small


def test_recipe_shapes():
    assert recipe("small_grt_isoflops").shape_name == "1+1x10+1"
    assert recipe("medium_grt_isoflops").shape_name == "2+5x4+2"
    assert recipe("large_grt_isoparams").shape_name == "3+30x6+3"
    for scale in ("small", "medium", "large"):  # isoFLOPs: same layer executions as dense
        assert recipe(f"{scale}_grt_isoflops").depth() == recipe(f"{scale}_dense").depth()
    assert recipe("small_dense").is_dense and not recipe("small_grt_isoflops").is_dense


def test_flops_match_paper_formula():
    cfg = recipe("small_grt_isoflops")
    d, s, r = cfg.hidden_size, 1024, 7
    parts = forward_flops_per_token(cfg, s, r)
    # The paper's 10·R·d² for the gate and projection, less the h_pre halves of W_in and W_1 (2·d² each
    # a step) that run once per forward instead of at every step.
    assert parts["layers"] + parts["recurrence"] == (1 + r + 1) * (24 * d * d + 4 * s * d) + 6 * r * d * d + 4 * d * d
    assert parts["output_layer"] == 2 * d * 50304
    dense = forward_flops_per_token(recipe("small_dense"), s)
    assert dense["recurrence"] == 0 and dense["layers"] == 12 * (24 * d * d + 4 * s * d)
    # Training: 3x forward, no-grad (truncated) steps forward only.
    full = train_flops_per_token(cfg, s, DepthDraw(5, 5))
    truncated = train_flops_per_token(cfg, s, DepthDraw(5, 2))
    assert full == 3 * forward_flops_per_token(cfg, s, 5)["total"]
    # ... and the first step with gradient computes no input gradient for W_in's state half.
    assert full - truncated == 2 * 3 * (24 * d * d + 4 * s * d + 6 * d * d) + 2 * d * d


@pytest.mark.parametrize("variant, overrides", [
    ("grt", {}), ("fixed-gate", {"gate": "fixed"}), ("add-injection", {"injection": "add"}),
    ("dense", {"recurrences": 1, "gate": "none", "injection": "none"}),
    ("rrt", {"gate": "none", "injection": "none", "lora_rank": 4}),
    ("truncated", {"depth_sampler": "heavy_tail"}),
])
def test_flops_count_the_products_that_run(world, variant, overrides):
    """flops.py against torch's FLOP counter over a training step's forward and backward: every matrix
    product the model runs, the hoisted h_pre halves of W_in and W_1 once per forward, the truncated
    steps forward only. (The CPU attention kernel is not counted by torch's counter: its term is taken off.)"""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny_config(**overrides)
    model = GRTLanguageModel(cfg, init_seed=0).train()
    b, s = 2, 16
    draw = DepthDraw(4, 2) if variant == "truncated" else DepthDraw(cfg.recurrences, cfg.recurrences)
    x = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss = model(x[:, :-1], x[:, 1:], recurrences=draw.recurrences, grad_recurrences=draw.grad_recurrences)
        loss.mean().backward()
    assert set(counter.get_flop_counts()["Global"]) <= {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}
    layer_runs = cfg.prelude_layers + cfg.coda_layers + cfg.core_layers * draw.recurrences
    grad_layer_runs = layer_runs - cfg.core_layers * draw.no_grad_recurrences
    attention = 4 * s * cfg.hidden_size * (3 * grad_layer_runs + (layer_runs - grad_layer_runs))
    assert counter.get_total_flops() == (train_flops_per_token(cfg, s, draw) - attention) * b * s


def test_gate_is_about_0_98_at_init(world):
    model = build(tiny_config(recurrences=4)).eval()
    with recording_recurrence_stats(model.block) as stats:
        model(tokens())
    gates = [s["gate_mean"] for s in stats]
    assert len(gates) == 4
    for g in gates:
        assert g == pytest.approx(torch.sigmoid(torch.tensor(4.0)).item(), abs=0.01)  # 0.982


def test_recurrence_stats_are_over_all_windows_whatever_the_split(world):
    """The diagnostics are sums divided once: two half-batches (two DP ranks' shares, or two micro-batches)
    give the whole batch's numbers; the first half alone (what was recorded before) does not."""
    model = build(tiny_config(recurrences=3, gate_bias_init=0.0)).eval()
    x = tokens(batch=4)
    with torch.no_grad(), recording_recurrence_stats(model.block) as whole:
        model(x)
    with torch.no_grad(), recording_recurrence_stats(model.block) as halves:
        model(x[:2])
        model(x[2:])
    with torch.no_grad(), recording_recurrence_stats(model.block) as first:
        model(x[:2])
    assert len(whole) == len(halves) == 3
    for w, h, f in zip(whole, halves, first):
        assert h["gate_mean"] == pytest.approx(w["gate_mean"], rel=1e-6)
        assert h["relative_update"] == pytest.approx(w["relative_update"], rel=1e-6)
        assert abs(f["relative_update"] / w["relative_update"] - 1) > 1e-4


def test_noise_only_in_training(world):
    model = build(tiny_config(noise_sigma=0.1))
    x = tokens()
    model.eval()
    assert torch.equal(model(x), model(x))  # evaluation is deterministic
    model.train()
    a, b = model(x, x), model(x, x)
    assert not torch.equal(a, b)  # fresh noise at every step
    quiet = build(tiny_config(noise_sigma=0.0)).train()
    assert torch.equal(quiet(x, x), quiet(x, x))  # with σ = 0 nothing else is random (no dropout)


@pytest.mark.parametrize("shape", ["per_token", "per_element"])
def test_noise_shapes(world, shape):
    model = build(tiny_config(noise_shape=shape)).train()
    h = torch.zeros(16, 2, 64)
    for seeds in (None, [11, 12]):
        eps = recurrence_noise(model.config, model.training, h, seeds, step=0, kind=0)
        assert eps.shape == ((16, 2, 1) if shape == "per_token" else (16, 2, 64))
        assert 0.03 < eps.std().item() < 0.3


def test_keyed_noise_follows_the_sample_not_the_batch(world):
    """A sample's training loss is the same alone or batched with others, given its noise seed:
    what makes data-parallel layouts and micro-batch sizes agree while noise is on."""
    model = build(tiny_config(noise_sigma=0.5, recurrences=3)).train()
    x = tokens(batch=3)
    together = model(x, x, noise_seeds=[101, 202, 303])
    alone = torch.cat([model(x[i : i + 1], x[i : i + 1], noise_seeds=[s]) for i, s in enumerate([101, 202, 303])])
    assert torch.allclose(together, alone, atol=1e-5)
    assert not torch.allclose(together, model(x, x, noise_seeds=[101, 202, 304]), atol=1e-5)
    # The steps and the two noise kinds draw different values.
    h = torch.zeros(4, 1, 8)
    draws = [recurrence_noise(model.config, True, h, [7], step, kind) for step in (0, 1) for kind in (0, 1)]
    assert len({d.sum().item() for d in draws}) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, per_token, shard", [((16, 3, 8), False, (1, 0)), ((7, 2, 5), True, (1, 0)),
                                                     ((16, 3, 8), False, (4, 2)), ((5, 2, 3), False, (2, 1))])
def test_keyed_noise_is_each_samples_own_randn_stream(world, dtype, shape, per_token, shard):
    """The noise stream is part of a run's results (resume, layouts, the committed grids): sample i's draw
    is σ · randn(full sequence) from a generator seeded by (seed, step, kind), its rank's slice under SP,
    to the bit, whatever the implementation does to draw it faster."""
    import numpy as np

    s, b, d = shape
    like, seeds, sigma = torch.zeros(shape, dtype=dtype), [41 + 7 * i for i in range(b)], 0.37
    shards, index = shard
    columns = []
    for seed in seeds:
        mixed = int(np.random.SeedSequence([seed, 3, 1]).generate_state(1, np.uint64)[0]) & (2**63 - 1)
        full = torch.randn((s * shards, 1 if per_token else d), generator=torch.Generator().manual_seed(mixed))
        columns.append(full[s * index : s * (index + 1)])
    expected = (torch.stack(columns, dim=1) * sigma).to(dtype)
    got = draw_noise(like, sigma, per_token, seeds, step=3, kind=1, shard=shard)
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, expected)


@pytest.mark.parametrize("injection", ["add", "none"])
def test_no_gate_single_step_equals_dense(world, injection):
    grt_cfg = tiny_config(gate="none", injection=injection, recurrences=1, noise_sigma=0.0)
    dense_cfg = tiny_config(prelude_layers=0, core_layers=3, coda_layers=0, recurrences=1, gate="none",
                            injection="none", noise_sigma=0.0)
    grt, dense = build(grt_cfg, seed=1), build(dense_cfg, seed=2)
    # Same parameter names and shapes: a dense checkpoint loads into the GRT and back.
    assert grt.state_dict().keys() == dense.state_dict().keys()
    dense.load_state_dict(grt.state_dict())
    x = tokens()
    assert torch.equal(grt.eval()(x), dense.eval()(x))
    assert torch.equal(grt.train()(x, x), dense.train()(x, x))


def test_gate_blends_state_and_core_output(world):
    """With the gate forced shut (g→1) the state is carried unchanged; forced open (g→0) it is o_r."""
    model = build(tiny_config(recurrences=2, noise_sigma=0.0)).eval()
    block = model.block
    h_pre = torch.randn(16, 2, 64)
    inputs = StepInputs(torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None])
    with torch.no_grad():
        block.gate_fc2.bias.fill_(60.0)
        assert torch.allclose(block.recurrence_step(h_pre, h_pre, inputs, 0), h_pre)
        block.gate_fc2.bias.fill_(-60.0)
        x, _ = block.injection(torch.cat([h_pre, h_pre], dim=-1))
        o = run_layers(block.core, x, inputs)
        # h + (1−g)·(o − h) with 1−g = 1 is o up to the rounding of h + (o − h) (|h| ~ 1: ~1e-7).
        assert torch.allclose(block.recurrence_step(h_pre, h_pre, inputs, 0), o, atol=1e-6)


@pytest.mark.parametrize("variant", ["grt", "fixed-gate", "add-injection"])
def test_hoisted_prelude_terms_give_the_step_of_the_concatenations(world, variant):
    """A step handed the forward's `prelude_terms` (the h_pre halves of W_in and W_1 multiplied once) is the
    step that multiplies [h + eps_x, h_pre] and [LN_a(h), LN_b(h_pre)] whole, as the equations are written:
    the same state and the same gradients of h, h_pre and every weight, to fp32 rounding, noise included."""
    overrides = {"fixed-gate": {"gate": "fixed"}, "add-injection": {"injection": "add"}}.get(variant, {})
    model = build(tiny_config(recurrences=2, gate_bias_init=0.0, **overrides)).train()
    block = model.block
    assert block.hoists_prelude_terms()
    gen = torch.Generator().manual_seed(0)
    h, h_pre = (torch.randn(16, 2, 64, generator=gen).requires_grad_() for _ in range(2))
    weights = [p for p in block.parameters() if p.requires_grad]
    inputs = StepInputs(None, noise_seeds=[3, 4])
    runs = []
    for hoisted in (False, True):
        terms = block.prelude_terms(h_pre) if hoisted else None
        out = block.recurrence_step(h, h_pre, inputs, 1, terms)
        grads = torch.autograd.grad(out.square().sum(), [h, h_pre, *weights], allow_unused=True)
        runs.append((out.detach(), grads))
    (want, want_grads), (got, got_grads) = runs
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(["h", "h_pre", *[n for n, p in block.named_parameters() if p.requires_grad]],
                          got_grads, want_grads):
        assert (g is None) == (w is None), name
        if w is not None:
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5), (name, float((g - w).abs().max()))
    assert not torch.equal(want, h)  # the step moved the state


def test_heavy_tail_steps_beyond_k_carry_no_gradient(world):
    model = build(tiny_config(recurrences=3, depth_sampler="heavy_tail", heavy_tail_k=2, noise_sigma=0.0))
    core_layer = model.block.core[0]
    grad_modes = []
    core_layer.register_forward_pre_hook(lambda mod, args: grad_modes.append(torch.is_grad_enabled()))
    x = tokens()
    loss = model(x, x, recurrences=5, grad_recurrences=2).mean()
    assert grad_modes == [False, False, False, True, True]
    loss.backward()
    # The same gradient as an explicit truncation: run 3 steps, detach, run 2 with gradient.
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    block = model.block
    original = block.run_core

    def explicit(h_pre, inputs, recurrences, grad_recurrences):
        h = h_pre
        for r in range(recurrences):
            h = block.recurrence_step(h if r >= 3 else h.detach(), h_pre, inputs, r)
            if r == 2:
                h = h.detach()
        return h

    block.run_core = explicit
    model(x, x, recurrences=5).mean().backward()
    block.run_core = original
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6), n


def test_recurrence_checkpointing_gives_identical_loss_and_grads(world):
    x = tokens()
    results = []
    for checkpoint in (False, True):
        cfg = tiny_config(recurrences=3, checkpoint_recurrence=checkpoint, noise_sigma=0.1,
                          hidden_dropout=0.1, attention_dropout=0.1)
        model = build(cfg, seed=3).train()
        torch.manual_seed(7)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
        loss = model(x, x).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=1e-5), name


def test_random_initial_state_is_deterministic_in_eval(world):
    model = build(tiny_config(initial_state="random")).eval()
    x = tokens()
    assert torch.equal(model(x), model(x))


def test_a_random_initial_state_needs_a_path_for_the_tokens(world):
    """Started from noise, the state sees the tokens only through the injection or the mlp gate: without
    both (an Ouro or RRT recipe given initial_state=random) the logits would not depend on the input."""
    for gate in ("none", "residual", "fixed"):
        with pytest.raises(ConfigError, match="nothing carries the prelude's output"):
            tiny_config(initial_state="random", injection="none", gate=gate)
    for injection, gate in (("concat_project", "none"), ("add", "none"), ("none", "mlp")):
        model = build(tiny_config(initial_state="random", injection=injection, gate=gate)).eval()
        with torch.no_grad():
            assert not torch.equal(model(tokens(seed=1)), model(tokens(seed=2))), (injection, gate)


def test_rope_model_runs(world):
    model = build(tiny_config(position_embedding="rope"))
    assert not any("position_embeddings" in n for n, _ in model.named_parameters())
    loss = model(tokens(), tokens()).mean()
    loss.backward()
    assert torch.isfinite(loss)


def test_logits_cut_vocab_padding(world):
    model = build(tiny_config(vocab_size=300)).eval()
    assert model.config.padded_vocab_size == 384
    assert model(tokens()).shape == (2, 16, 300)


@pytest.mark.parametrize("field,value,needle", [
    ("gate", "lstm", "model.gate='lstm'"),
    ("injection", "mul", "model.injection='mul'"),
    ("depth_sampler", "poisson", "model.depth_sampler='poisson'"),
    ("recurrences", 0, "model.recurrences must be >= 1"),
    ("noise_shape", "per_batch", "model.noise_shape='per_batch'"),
])
def test_bad_model_fields_are_named(field, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")):
        tiny_config(**{field: value})


def test_unknown_model_field_is_named():
    with pytest.raises(ConfigError, match="unknown model field.*num_layer"):
        tiny_config(num_layer=3)
