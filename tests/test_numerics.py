"""bf16 numerics of the recurrence and of the gradients.

Near g = 1 the gate's update (1 − g)·(o − h) is small next to h: bf16 (steps of 2^-8 near 1) rounds most
of it away when the blend is computed as g·h + (1 − g)·o and the state is kept in bf16. The block carries
the state in fp32 and blends as h + sigmoid(−a)·(o − h); the layers stay bf16. Gradients of bf16 layers
accumulate and reduce in fp32 (DeepSpeed's `data_types.grad_accum_dtype`, `communication_data_type`).
"""

import pytest
import torch

from grt_megatron.model.diagnostics import recording_recurrence_stats

RECIPE = dict(hidden_size=64, num_attention_heads=4, vocab_size=300, max_sequence_length=32, prelude_layers=1,
              core_layers=1, coda_layers=1, recurrences=4, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, noise_sigma=0.0, gate_bias_init=6.0)  # g ≈ 0.9975 at init


def _pair():
    """The same model in fp32 and bf16 (bf16 weights = the fp32 weights rounded)."""
    from grt_megatron.model import GRTConfig, GRTLanguageModel

    fp32 = GRTLanguageModel(GRTConfig.from_recipe(RECIPE), init_seed=5).eval()
    bf16 = GRTLanguageModel(GRTConfig.from_recipe(RECIPE, precision="bf16"), init_seed=5).eval()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        for p32, p16 in zip(fp32.parameters(), bf16.parameters()):
            p16.copy_(p32)
    return fp32, bf16


def _updates(model, tokens):
    """h_r − h_{r−1} of every recurrence step (as the block carries them), and the states' dtype."""
    block, seen = model.block, []
    step = block.recurrence_step

    def recording(h, h_pre, inputs, r, *terms):
        out = step(h, h_pre, inputs, r, *terms)
        seen.append(out - h)
        return out

    block.recurrence_step = recording
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        del block.recurrence_step
    return seen


def _relative_error(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_bf16_state_update_within_a_few_percent_of_fp32_near_g_1(world):
    fp32, bf16 = _pair()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    want, got = _updates(fp32, tokens), _updates(bf16, tokens)
    assert len(got) == RECIPE["recurrences"]
    assert all(u.dtype == torch.float32 for u in got)  # the state is carried in fp32 under bf16 layers
    errors = [_relative_error(g, w) for g, w in zip(got, want)]
    assert max(errors) < 0.05, errors


def test_bf16_blend_of_the_old_form_loses_the_update():
    """Why the form matters (and that the 5% bound above can fail): the same h, o and gate logits a,
    blended in bf16 as g·h + (1 − g)·o, lose most of the update, where h + sigmoid(−a)·(o − h) with h in
    fp32 keeps it; both against the exact update in float64."""
    gen = torch.Generator().manual_seed(0)
    h, o = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    a = 6.0 + 0.1 * torch.randn(4096, generator=gen)
    a16, o16 = a.bfloat16(), o.bfloat16()
    exact = torch.sigmoid(-a16.double()) * (o16.double() - h.double())
    g16 = torch.sigmoid(a16)
    old = (g16 * h.bfloat16() + (1 - g16) * o16).double() - h.bfloat16().double()
    new = torch.sigmoid(-a16.float()) * (o16.float() - h)
    assert _relative_error(old, exact) > 0.5
    assert _relative_error(new, exact) < 1e-3


def test_bf16_eval_diagnostics_agree_with_fp32(world):
    fp32, bf16 = _pair()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    stats = []
    for model in (fp32, bf16):
        with torch.no_grad(), recording_recurrence_stats(model.block) as recorded:
            model(tokens)
        stats.append(recorded)
    for want, got in zip(*stats):
        assert got["gate_mean"] == pytest.approx(want["gate_mean"], abs=1e-3)
        assert got["relative_update"] == pytest.approx(want["relative_update"], rel=0.05)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_gradients_accumulate_and_reduce_in_fp32(world, zero_stage):
    """Read back from the optimizer DeepSpeed built: its gradient accumulation buffers are fp32, and so
    is the dtype it reduces gradients in, at every ZeRO stage (stage 0 runs as DeepSpeed's BF16 optimizer,
    the only fp32-accumulating bf16 path it has without sharding)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.training.config import build_run_config
    from grt_megatron.parallel.deepspeed_engine import build_engine

    run = build_run_config({"model": {k: v for k, v in RECIPE.items() if k != "vocab_size"},
                            "train": {"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 4},
                            "data": {"source": "unused"}, "deepspeed": {"zero_stage": zero_stage}}, world_size=1)
    engine = build_engine(GRTLanguageModel(run.model_config(300), init_seed=0), run, dp_size=1)
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.communication_data_type == torch.float32
    optimizer = engine.optimizer
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    engine.backward(engine(tokens, tokens).mean())  # the first of two micro-batches: accumulated, not stepped
    if zero_stage <= 1:
        assert isinstance(optimizer, BF16_Optimizer)
        buffers = optimizer.fp32_groups_gradients_flat
        assert buffers and all(b.dtype == torch.float32 for b in buffers)
        assert any(b.abs().sum() > 0 for b in buffers)  # the micro-batch's gradients were summed into them
    else:
        assert optimizer.gradient_accumulation_dtype == torch.float32
    engine.step()
    engine.backward(engine(tokens, tokens).mean())
    engine.step()
    assert engine.global_steps == 1


ENGINE_PATHS = [("fp32", 0, "fp32", False), ("bf16", 0, "fp32", False), ("bf16", 0, "bf16", False),
                ("fp32", 1, "fp32", True), ("bf16", 2, "fp32", True)]


@pytest.mark.parametrize("precision,zero_stage,accum,reduces", ENGINE_PATHS,
                         ids=[f"{p}-zero{z}-accum{a}" for p, z, a, _ in ENGINE_PATHS])
def test_one_rank_skips_the_gradient_all_reduce_and_trains_the_same_bits(world, precision, zero_stage, accum,
                                                                          reduces):
    """With one data-parallel rank the engine skips DeepSpeed's gradient all-reduce where it only
    communicates (no ZeRO, the BF16 optimizer): two steps of two micro-batches give the same weights, to the
    bit, as with the all-reduce forced back on. ZeRO's optimizers partition gradients in that call: kept."""
    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.parallel.deepspeed_engine import build_engine
    from grt_megatron.training.config import build_run_config
    from grt_megatron.training.step_guard import master_weights

    run = build_run_config({"model": {k: v for k, v in RECIPE.items() if k != "vocab_size"},
                            "train": {"precision": precision, "micro_batch_size": 2, "global_batch_size": 4,
                                      "grad_clip": 1.0, "warmup_iters": 1},
                            "data": {"source": "unused"},
                            "deepspeed": {"zero_stage": zero_stage, "grad_accum_dtype": accum}}, world_size=1)
    tokens = torch.randint(0, 300, (4, 2, 32), generator=torch.Generator().manual_seed(3))

    def trained(all_reduce):
        engine = build_engine(GRTLanguageModel(run.model_config(300), init_seed=0), run, dp_size=1)
        assert engine.enable_backward_allreduce is reduces
        engine.enable_backward_allreduce = all_reduce
        for micro in tokens:
            engine.backward(engine(micro, micro).mean())
            engine.step()
        assert engine.global_steps == 2
        return [p.detach().clone() for p in master_weights(engine)], list(engine.module.parameters())

    (skipped, model), (reduced, _) = trained(reduces), trained(True)
    assert len(skipped) == len(reduced) > 0 and all(torch.equal(a, b) for a, b in zip(skipped, reduced))
    initial = list(GRTLanguageModel(run.model_config(300), init_seed=0).parameters())
    assert sum(not torch.equal(a, b) for a, b in zip(model, initial)) > len(initial) // 2  # it trained
