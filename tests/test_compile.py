"""`train.compile`: compiled training equals eager, and a varying depth never recompiles."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_step, cli_env, loss_and_grads, read_jsonl, run_cli, tiny_config
from grt_megatron.model import GRTLanguageModel
from grt_megatron.parallel.compile import apply_compile

QUIET = ["logging.wandb=disabled", "logging.progress=false"]


def _train(prefix, run_dir, extra=()):
    # GRT with noise, R ~ heavy tail (2 … 8 here) with backprop through the last 2 steps only, and
    # recurrence checkpointing: every path around the compiled step (no_grad steps, recompute, noise).
    proc = run_cli(["model=tiny", "data=indexed", f"data.prefixes=[{prefix}]", "model.depth_sampler=heavy_tail",
                    "+model.heavy_tail_k=2", "model.checkpoint_recurrence=true", "train.iters=8",
                    "train.eval_interval=4", "train.eval_iters=1", "train.global_batch_size=8",
                    "train.micro_batch_size=4", "checkpoint.save_at_end=false", f"run.dir={run_dir}", *QUIET,
                    *extra])
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


def _edges_into(loss: torch.Tensor, params) -> list[int]:
    """For each of `params`, how many nodes of `loss`'s autograd graph hand it a gradient: under autocast,
    how many casts of it the forward made (each cast's backward is one)."""
    counts = {id(p): 0 for p in params}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and id(getattr(child, "variable", None)) in counts:
                counts[id(child.variable)] += 1
            stack.append(child)
    return [counts[id(p)] for p in params]


CAST_ONCE_CASES = {
    # R = 5 with backprop through the last 3 steps; with recurrence checkpointing (recompute in backward).
    "grt": (dict(recurrences=5), 3),
    "grt-recompute": (dict(recurrences=5, checkpoint_recurrence=True), 3),
    # MoR: its core's layers compiled one by one, run at every recursion (R = 3).
    "mor": (dict(routing="expert_choice", gate="none", injection="none"), 3),
}


@pytest.mark.parametrize("case", list(CAST_ONCE_CASES))
def test_compiled_bf16_mixed_casts_the_shared_weights_once_per_forward(world, case):
    """Compiled under bf16-mixed, the shared core's linears get their weights cast once per forward, as eager
    autocast's cache does, not once per step inside the compiled graphs: one cast (one gradient edge) per
    shared weight, and with `cast_weights_once=False` one per step with gradient. Between forwards the
    weights change in place (as an optimizer step changes them), and the next forward casts them anew:
    losses follow eager's."""
    from grt_megatron.parallel.compile import MoRCoreWithWeightsCastOnce, StepWithWeightsCastOnce
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision

    overrides, steps_with_grad = CAST_ONCE_CASES[case]
    # An open gate (b_2 = 0, g = 1/2 at init), so that the core's weights weigh in the loss.
    cfg = tiny_config(noise_sigma=0.0, depth_sampler="fixed", gate_bias_init=0.0, **overrides)
    r = cfg.recurrences
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    edges, losses = {}, {}
    for mode in ("eager", "in_graph", "once"):
        model = GRTLanguageModel(cfg, init_seed=3).train()
        apply_mixed_precision(model, "bf16-mixed", torch.device("cpu"))
        if mode != "eager":
            apply_compile(model, cast_weights_once=mode == "once")
        wrapper = model.block.run_core if case == "mor" else model.block.step_math
        assert isinstance(wrapper, (StepWithWeightsCastOnce, MoRCoreWithWeightsCastOnce)) == (mode == "once")
        names, shared = zip(*[(n, p) for n, p in model.named_parameters()
                              if p.dim() == 2 and (".layers.1." in n or "injection" in n or "gate_fc" in n)])
        assert len(shared) == (4 if case == "mor" else 7)
        losses[mode] = []
        for _ in range(2):
            loss = model(tokens[:, :-1], tokens[:, 1:], r, steps_with_grad).mean()
            edges[mode] = _edges_into(loss, shared)
            loss.backward()
            losses[mode].append(float(loss))
            with torch.no_grad():
                for i, p in enumerate(shared):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), alpha=0.1)
        del loss
        if mode == "once" and case != "mor":  # the casts went with their forward's graph
            assert wrapper._casts == []
    n = len(shared)
    # W_in and W_1 come to the steps cast once per forward in every mode (their state halves, beside the
    # hoisted h_pre products: GatedRecurrentBlock.prelude_terms).
    in_graph = [1 if "injection" in name or "gate_fc1" in name else steps_with_grad for name in names]
    assert edges == {"eager": [1] * n, "in_graph": in_graph, "once": [1] * n}
    assert abs(losses["eager"][1] - losses["eager"][0]) > 1e-2  # the second forward saw the new weights
    for mode in ("in_graph", "once"):
        for got, want in zip(losses[mode], losses["eager"]):
            assert got == pytest.approx(want, rel=1e-3), (mode, losses)


def _tensor_parallel_worker(out: Path) -> None:
    """One of two ranks (torchrun this file): the tiny GRT at TP 2, with and without sequence parallelism
    (every TP and SP collective in the compiled layers and recurrence step), eager and compiled; writes
    the largest gradient difference per layout and the graph breaks dynamo met."""
    import torch.distributed as dist

    from grt_megatron.distributed import init_distributed

    init_distributed(tp=2, seed=0, timeout_minutes=2)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    result = {}
    for sp in (False, True):
        cfg = tiny_config(dict(tensor_model_parallel_size=2, sequence_parallel=sp), noise_sigma=0.0,
                          depth_sampler="fixed")
        runs = []
        for compiled in (False, True):
            model = GRTLanguageModel(cfg, init_seed=3)
            if compiled:
                apply_compile(model)
            runs.append(loss_and_grads(model, tokens))
        (eager_loss, eager), (loss, grads) = runs
        result["sp" if sp else "tp"] = {
            "loss": abs(float(loss) / float(eager_loss) - 1),
            "grads": {name: float((grads[name] - g).abs().max() / g.abs().max()) for name, g in eager.items()}}
    result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def test_compiled_tensor_and_sequence_parallel_gradients_equal_eager(tmp_path):
    """Compiled at TP 2 (+ SP) the model traces with no graph break and every gradient is eager's. Traced as
    megatron wrote them, the collectives broke every TP linear's graph (async ones), and on torch 2.11 the
    SP backward's all-gathers were dropped: every gradient wrong, the loss right (parallel/traceable_tp.py)."""
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_port=29875", __file__, str(out)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graph_breaks"] == 0
    for layout in ("tp", "sp"):
        assert result[layout]["loss"] < 1e-6, (layout, result[layout]["loss"])
        worst = max(result[layout]["grads"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-4, (layout, worst)  # each tensor's largest difference over its largest entry


if __name__ == "__main__":  # a rank of test_compiled_tensor_and_sequence_parallel_gradients_equal_eager
    _tensor_parallel_worker(Path(sys.argv[1]))
