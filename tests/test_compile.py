"""`train.compile`: compiled training equals eager, and a varying depth never recompiles."""

import sys

import pytest
import torch

from conftest import assert_same_step, loss_and_grads, read_jsonl, run_cli, tiny_config
from grt_megatron.model import GRTLanguageModel
from grt_megatron.parallel.compile import apply_compile

QUIET = ["logging.wandb=disabled", "logging.progress=false"]


def _train(prefix, run_dir, extra=(), launcher=None):
    # GRT with noise, R ~ heavy tail (2 … 8 here) with backprop through the last 2 steps only, and
    # recurrence checkpointing: every path around the compiled step (no_grad steps, recompute, noise).
    proc = run_cli(["model=tiny", "data=indexed", f"data.prefixes=[{prefix}]", "model.depth_sampler=heavy_tail",
                    "+model.heavy_tail_k=2", "model.checkpoint_recurrence=true", "train.iters=8",
                    "train.eval_interval=4", "train.eval_iters=1", "train.global_batch_size=8",
                    "train.micro_batch_size=4", "checkpoint.save_at_end=false", f"run.dir={run_dir}", *QUIET,
                    *extra], launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(run_dir / "metrics.jsonl")


def test_compiled_training_equals_eager_and_never_recompiles(pydoc_prefix, tmp_path):
    eager = _train(pydoc_prefix[0], tmp_path / "eager")
    compiled = _train(pydoc_prefix[0], tmp_path / "compiled", ["train.compile=true"])
    assert [(r.get("split"), r["step"]) for r in eager] == [(r.get("split"), r["step"]) for r in compiled]
    for e, c in zip(eager, compiled):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-3), (e, c)
        if e.get("grad_norm") is not None:
            assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-3), (e, c)
    steps = [r for r in compiled if "split" not in r]
    assert len({r["recurrences"] for r in steps}) >= 3, "the depth sampler should vary R over 8 steps"
    assert any(r["grad_recurrences"] < r["recurrences"] for r in steps)
    # Graphs: the step (with gradient, without, and the first step with gradient after no_grad ones), the
    # prelude and coda layers and the loss's two chunk kernels (sums, gradient) after step 1; their
    # evaluation forms after the first evaluation (step 4). From then on, whatever R the sampler draws,
    # nothing recompiles.
    after_eval = [r["compiled_graphs"] for r in steps if r["step"] > 4]
    assert len(set(after_eval)) == 1 and after_eval[0] <= 10, [r["compiled_graphs"] for r in steps]
    assert "compiled_graphs" not in eager[0]

    # Tensor and sequence parallelism compile to the same graphs, none broken at a TP collective (megatron's
    # asynchronous ones broke every TP linear's graph, and the recurrence step ran eager: 20 graphs in 2
    # steps where one process builds 4), and still give one process's numbers.
    sharded = _train(pydoc_prefix[0], tmp_path / "tp2-sp", ["train.compile=true", "parallel.tp=2", "parallel.sp=true"],
                     launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--master_port=29875"])
    assert [r["compiled_graphs"] for r in sharded if "split" not in r] == [r["compiled_graphs"] for r in steps]
    for e, c in zip(eager, sharded):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5), (e, c)
        if e.get("grad_norm") is not None:
            assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5), (e, c)


@pytest.mark.parametrize("overrides", [
    dict(prelude_layers=1, core_layers=2, coda_layers=1, recurrences=1, injection="none", gate="none",
         noise_sigma=0.0, depth_sampler="fixed"),  # dense: its core is one compiled step
    dict(routing="expert_choice", gate="none", injection="none", noise_sigma=0.0, depth_sampler="fixed"),  # MoR
], ids=["dense", "mor"])
def test_compiled_model_equals_eager_and_keeps_parameter_names(world, overrides):
    cfg = tiny_config(**overrides)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = GRTLanguageModel(cfg, init_seed=3)
        names = list(model.state_dict())
        if compiled:
            assert apply_compile(model) >= 3
            assert list(model.state_dict()) == names  # checkpoints of both runs are the same files
        results.append(loss_and_grads(model, tokens))
    eager, compiled = results
    assert_same_step(compiled, eager, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_compiled_model_under_bf16_mixed_stays_within_bf16_of_fp32(world):
    """train.compile over train.precision=bf16-mixed (the autocast wrapper outside, the compiled recurrence
    step and layers inside, as parallelize applies them): inductor fuses the casts around the bf16 matmuls,
    so compiled and eager round differently; each is as far from the fp32 model as bf16 puts it (measured:
    loss 2e-5 relative, gradients ≤ 1.2% of each tensor's largest, for both)."""
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision

    cfg = tiny_config(noise_sigma=0.0, depth_sampler="fixed")
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("fp32", "eager", "compiled"):
        model = GRTLanguageModel(cfg, init_seed=3)
        if mode != "fp32":
            assert apply_mixed_precision(model, "bf16-mixed", torch.device("cpu"))
        if mode == "compiled":
            assert apply_compile(model) >= 2
        results[mode] = loss_and_grads(model, tokens)
    fp32 = results["fp32"]
    for mode in ("eager", "compiled"):
        loss, grads = results[mode]
        assert loss != fp32[0] and abs(loss / fp32[0] - 1) < 1e-4, mode  # bf16 ran, within its rounding
        for name, want in fp32[1].items():
            assert grads[name].dtype == torch.float32
            assert (grads[name] - want).abs().max() <= 3e-2 * want.abs().max(), (mode, name)
