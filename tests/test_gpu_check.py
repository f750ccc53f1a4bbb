"""tools/gpu_check.py: its pure helpers, and the whole script in CPU mode (what it runs on a GPU, with tiny
shapes), which must pass every check and write the report it promises."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()
from tools import gpu_check_checks, gpu_check_runner  # noqa: E402 (loading gpu_check put REPO on sys.path)


def test_train_losses_ignore_evaluation_records():
    records = [{"step": 1, "loss": 7.0}, {"step": 1, "split": "valid", "loss": 6.0}, {"step": 2, "loss": 6.5},
               {"step": 2, "split": "depth_sweep", "recurrences": 1, "loss": 6.9}]
    assert gpu_check_checks.train_losses(records) == {1: 7.0, 2: 6.5}


def test_compare_loss_curves_separates_the_control_from_the_resumed_steps():
    reference = {1: 7.0, 2: 6.5, 3: 6.25, 4: 6.0}
    same = gpu_check_checks.compare_loss_curves(reference, dict(reference), resumed_from=2)
    assert same["bit_exact"] and same["max_abs_diff"] == 0 and same["first_mismatch_step"] is None
    assert gpu_check_checks.resume_passed(same, "cpu", deterministic=True)

    # Only the resumed steps differ: the resume changed something; never accepted.
    drifted = gpu_check_checks.compare_loss_curves(reference, {**reference, 3: 6.26, 4: 6.01}, resumed_from=2)
    assert not drifted["bit_exact"] and drifted["first_mismatch_step"] == 3
    assert drifted["control_max_abs_diff"] == 0 and drifted["after_resume_max_abs_diff"] == pytest.approx(0.01)
    assert not any(gpu_check_checks.resume_passed(drifted, mode, d) for mode in ("cpu", "cuda") for d in (True, False))

    # The killed run (no resume yet) already differs: GPU nondeterminism, accepted within the band on CUDA
    # unless deterministic kernels were asked for.
    noisy = gpu_check_checks.compare_loss_curves(reference, {1: 7.0, 2: 6.5001, 3: 6.2502, 4: 6.0003}, resumed_from=2)
    assert noisy["control_max_abs_diff"] > 0 and noisy["same_steps"]
    assert gpu_check_checks.resume_passed(noisy, "cuda", deterministic=False)
    assert not gpu_check_checks.resume_passed(noisy, "cuda", deterministic=True)
    assert not gpu_check_checks.resume_passed(noisy, "cpu", deterministic=False)

    missing = gpu_check_checks.compare_loss_curves(reference, {1: 7.0, 2: 6.5, 3: 6.25}, resumed_from=2)
    assert not missing["same_steps"] and not missing["bit_exact"] and missing["first_mismatch_step"] == 4
    assert not gpu_check_checks.resume_passed({**missing, "control_max_abs_diff": 1e-4}, "cuda", deterministic=False)


def test_bf16_logits_tolerance_scales_with_the_logits():
    assert gpu_check_checks.logits_tolerance("fp32", 50.0) == 1e-4
    assert gpu_check_checks.logits_tolerance("bf16", 0.5) == 2e-2
    assert gpu_check_checks.logits_tolerance("bf16", 8.0) == pytest.approx(0.16)


def test_report_is_written_atomically_and_strict_json(tmp_path):
    out = tmp_path / "results" / "report.json"
    gpu_check_runner.write_json_atomically(out, {"a": [1.0, float("nan")], "b": {"c": float("inf")}})
    assert json.loads(out.read_text()) == {"a": [1.0, None], "b": {"c": None}}
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]


def test_time_guard_refuses_to_start_when_spent():
    clock = gpu_check_runner.Clock(budget_s=100.0)
    assert clock.timeout(30) == 30
    clock.budget_s = 1.0
    with pytest.raises(gpu_check_runner.CheckFailed, match="time guard"):
        clock.timeout(30)


def test_a_failed_check_is_summarised_by_its_error_line_not_a_warning_after_it(monkeypatch):
    def failing(ctx):
        raise gpu_check_runner.CheckFailed("worker-3-hf: exit status 1\nTraceback (most recent call last):\n"
                                           "TypeError: __init__() got an unexpected keyword argument 'cache'\n"
                                           "[rank0]:[W1204] Warning: destroy_process_group() was not called")

    monkeypatch.setitem(gpu_check_checks.CHECK_FUNCTIONS, "hf_logits", failing)
    ctx = gpu_check_runner.Context(mode=gpu_check_runner.mode_for(cuda=False, steps=None), work=REPO,
                                   clock=gpu_check_runner.Clock(9.0), env={})
    row = gpu_check.run_check(ctx, "hf_logits")
    assert not row["passed"]
    assert row["summary"] == ("worker-3-hf: exit status 1 ... "
                              "TypeError: __init__() got an unexpected keyword argument 'cache'")


def test_checks_skipped_now_are_carried_from_an_earlier_report(tmp_path):
    earlier = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "date": "2026-12-04T11:01:41+0000", "mode": "cuda",
               "checks": [{"name": "kill_resume_bf16", "passed": True, "wall_s": 59.2, "summary": "bit-exact",
                           "detail": {}},
                          {"name": "hf_logits", "passed": False, "wall_s": 0.0, "summary": "x", "detail": {}}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    carried = gpu_check.carried_checks(path, ["kill_resume_bf16", "medium_compiled"], "cuda")
    assert list(carried) == ["kill_resume_bf16"]  # hf_logits runs again; medium_compiled was never there
    assert carried["kill_resume_bf16"]["passed"] and carried["kill_resume_bf16"]["carried_from"] == {
        "date": "2026-12-04T11:01:41+0000", "torch": "2.11.0+cu130", "device": "NVIDIA H200"}
    with pytest.raises(SystemExit, match="earlier.json: a cuda-mode report; this run is cpu mode"):
        gpu_check.carried_checks(path, ["kill_resume_bf16"], "cpu")
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="earlier.json: not a gpu_check report"):
        gpu_check.carried_checks(path, ["kill_resume_bf16"], "cuda")


def test_profile_summary_names_host_ops_kernels_and_waits():
    """tools/bench/gpu_mfu.py's breakdown of the profiled step, on a CPU profile (no kernels there)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO))
    from tools.bench.gpu_mfu import profile_top

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64)
        for _ in range(3):
            a = a @ a
        a.sum().item()
    top = profile_top(prof, rows=4)
    assert len(top["top_host_ops"]) == 4 and all(ms >= 0 and count >= 1 for _, ms, count in top["top_host_ops"])
    assert ["aten::matmul", 3] in [[name, count] for name, _, count in top["top_host_ops"] + top["top_kernels"]] \
        or any(name == "aten::mm" for name, _, _ in top["top_host_ops"])
    assert any(name == "aten::item" and count == 1 for name, _, count in top["host_waits"])


def test_memory_ops_name_the_tensor_and_who_moved_it():
    """The profile's memory-bound ops come grouped by shape and caller, outermost op only: a `.float()` of a
    transposed bf16 tensor is one `_to_copy` (not also its inner `copy_`), named with the function that
    asked for it and counted once per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO))
    from tools.bench.gpu_mfu import memory_op_profiling, memory_ops

    def widen(t):
        return t.float()

    weights = torch.randn(96, 32, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], **memory_op_profiling()) as prof:
        for _ in range(3):
            widen(weights.t())
        torch.zeros(5, 7).add_(1.0)
    rows = {(name, tuple(shape)): (caller, count) for name, shape, caller, ms, count in memory_ops(prof, 12, False)}
    caller, count = rows[("aten::_to_copy", (32, 96))]
    assert count == 3 and caller.endswith(": widen")
    assert ("aten::copy_", (32, 96)) not in rows  # inside the _to_copy: not counted again
    assert rows[("aten::add_", (5, 7))][1] == 1


def test_memory_traffic_counts_what_each_op_reads_and_writes():
    """tools/bench/memory_traffic.py's count: reads plus writes, an in-place operand both; a fill, a copy's
    destination and an `out=` written only; a gather reads its rows, not its table, a scatter writes its rows;
    matmuls and views not at all; fused AdamW reads weights, gradients and moments and writes weights and
    moments; each op charged to its caller."""
    sys.path.insert(0, str(REPO))
    from tools.bench.memory_traffic import CountBytes

    a, b, table, rows = torch.ones(1000), torch.ones(1000), torch.ones(50, 10), torch.tensor([1, 2])
    wide, narrow = torch.ones(64, 32), torch.ones(32, 16)
    destination = torch.empty(1000, dtype=torch.bfloat16)
    weights, gradients, exp_avg, exp_avg_sq = (torch.ones(100) for _ in range(4))
    step, zeros = torch.ones(()), torch.zeros(2, 10)
    cases = {"add": (lambda: a + b, 12000), "add_": (lambda: a.add_(b), 12000), "zero_": (lambda: a.zero_(), 4000),
             "copy_": (lambda: destination.copy_(a), 6000), "to": (lambda: a.to(torch.bfloat16), 6000),
             "embedding": (lambda: torch.nn.functional.embedding(rows, table), 80 + 16 + 80),
             "exp out=": (lambda: torch.exp(a, out=b), 8000),
             "scatter": (lambda: table.index_put_((rows,), zeros), 16 + 80 + 80),
             "matmul": (lambda: wide @ narrow, 0), "view": (lambda: a.view(10, 100).t(), 0),
             "fused_adamw": (lambda: torch._fused_adamw_([weights], [gradients], [exp_avg], [exp_avg_sq], [],
                                                         [step], lr=1e-3, beta1=0.9, beta2=0.95,
                                                         weight_decay=0.1, eps=1e-8, amsgrad=False,
                                                         maximize=False), 4 * 400 + 3 * 400 + 4)}
    for name, (op, want) in cases.items():
        with CountBytes() as count:
            op()
        assert count.bytes == want, (name, count.bytes, want)

    def blend():
        return a * 2 + b  # mul: reads a, writes a temporary; add: reads it and b, writes the sum

    x = torch.ones(100, requires_grad=True)
    with CountBytes() as count:
        blend()
        (x * 3).sum().backward()
    callers = dict(count.by_caller)
    assert callers.pop(next(c for c in callers if c.endswith(": blend"))) == 8000 + 12000
    assert any(caller.startswith("backward: MulBackward0") for caller in callers), callers


def test_memory_traffic_counts_compiled_kernels_as_inductor_lowers_them(world):
    """memory_traffic.py --compile: each run of a compiled graph adds what its fused kernels load and store,
    forward to the frame that ran it, backward to the same frame; an in-place add into an input is read and
    written, a store into an input written only. The loss's compiled backward stores each chunk's gradient
    into the logits' gradient: 2 bytes a bf16 logit read, 2 written, and the rows' few numbers."""
    sys.path.insert(0, str(REPO))
    from grt_megatron.model.loss import chunked_vocab_parallel_cross_entropy
    from tools.bench.memory_traffic import CountBytes, InductorBytes

    def blend(a, b):
        return torch.sigmoid(a) * 2 + b

    def add_into(x, y):
        x.add_(y)

    def store_into(x, y):
        x.copy_(y * 2)

    a, b = torch.ones(1000, requires_grad=True), torch.ones(1000)
    s, batch, v, rows = 8, 3, 200, 10  # 24 rows: chunks of 10, 10 and 4
    logits = torch.randn(s, batch, v, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (s, batch))
    with InductorBytes() as inductor:
        compiled = {f: torch.compile(f, dynamic=False) for f in (blend, add_into, store_into)}

        def run():
            compiled[blend](a, b).sum().backward()
            compiled[add_into](torch.ones(1000), b)
            compiled[store_into](torch.ones(1000), b)
            chunked_vocab_parallel_cross_entropy(logits, target, chunk_bytes=4 * v * rows, fused=True).sum().backward()

        run()  # compiles
        lowered = inductor.lowered
        with CountBytes() as count:
            run()
    assert inductor.lowered == lowered
    callers = {caller: n for caller, n in count.by_caller.items() if caller.startswith("compiled")}
    # forward: a and b read, the sum written (sigmoid(a) recomputed in backward, nothing saved);
    # backward: the incoming gradient and a read, a's gradient written
    for kind in ("compiled: ", "compiled backward: "):
        assert callers.pop(next(c for c in callers if c.startswith(kind) and c.endswith(": blend"))) == 12000
    assert callers.pop(next(c for c in callers if c.endswith(": add_into"))) == 12000
    assert callers.pop(next(c for c in callers if c.endswith(": store_into"))) == 8000
    backward = callers.pop(next(c for c in callers if "CrossEntropyBackward" in c))
    n = s * batch
    assert backward == 2 * 2 * n * v + n * (4 + 4 + 8 + 4 + 4), backward  # row max, sum, target, hit, gradient
    assert all("loss.py" in c for c in callers), callers  # left: the loss's forward sums
    # and no logits-sized pass outside the kernel (a returned chunk copied into the gradient: 4 bytes a logit)
    eager = sum(n for c, n in count.by_caller.items() if c == "backward: _ChunkedVocabParallelCrossEntropyBackward")
    assert eager < n * v, eager


def test_train_overrides_reach_the_cli_runs(tmp_path):
    ctx = gpu_check_runner.Context(mode=gpu_check_runner.mode_for(cuda=True, steps=None), work=tmp_path,
                                   clock=gpu_check_runner.Clock(100.0), env={})
    ctx.results.update(corpus="corpus", train_overrides=[*gpu_check_checks.TRAIN_OVERRIDES, "train.fused_adam=true"])
    args = gpu_check_checks.train_args(ctx, tmp_path / "run", "resume=auto")
    assert "train.fused_adam=true" in args and "train.deterministic=true" in args and args[-1] == "resume=auto"
    assert [a for a in args if a.startswith("train.precision=")] == ["train.precision=bf16"]
    # A precision override replaces bf16 (one value, not two), and the checks then expect it.
    ctx.results["train_overrides"].append("train.precision=bf16-mixed")
    args = gpu_check_checks.train_args(ctx, tmp_path / "run")
    assert [a for a in args if a.startswith("train.precision=")] == ["train.precision=bf16-mixed"]
    assert gpu_check_checks.train_precision(ctx) == "bf16-mixed"


def test_a_refused_deterministic_mode_is_recorded_and_the_run_repeated_without_it(tmp_path, monkeypatch):
    ctx = gpu_check_runner.Context(mode=gpu_check_runner.mode_for(cuda=True, steps=None), work=tmp_path,
                                   clock=gpu_check_runner.Clock(100.0), env={})
    ctx.results.update(corpus="corpus")
    commands = []

    def fake_run_command(ctx, cmd, name, timeout_s, env=None):
        commands.append(cmd)
        (tmp_path / "run").mkdir(exist_ok=True)
        if "train.deterministic=true" in cmd:
            raise gpu_check_runner.CheckFailed(f"{name}: exit status 1\nRuntimeError: index_add_cuda_ does not "
                                               "have a deterministic implementation")
        return "done"

    monkeypatch.setattr(gpu_check_checks, "run_command", fake_run_command)
    out, refused = gpu_check_checks.train_uninterrupted(ctx, tmp_path / "run")
    assert out == "done" and "index_add_cuda_" in refused and len(commands) == 2
    assert "train.deterministic=true" in commands[0] and "train.deterministic=true" not in commands[1]
    assert not gpu_check_checks.deterministic_kernels(ctx)  # the killed and resumed runs go without it too


def test_gpu_check_in_cpu_mode_passes_every_check(tmp_path):
    output, work = tmp_path / "gpu_check.json", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k not in gpu_check_runner.LAUNCHER_ENV}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--cpu", "--output", str(output),
                           "--work-dir", str(work), "--medium-baseline-precision", "bf16-mixed"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(output.read_text())
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    n = len(gpu_check_checks.CHECKS)
    assert f"{n}/{n} checks passed" in proc.stdout and "PASS kill_resume_bf16" in proc.stdout  # progress lines

    assert {"device", "torch", "python", "date", "mode", "wall_s", "checks", "mfu_grt_medium", "mfu_dense_medium",
            "grt_over_dense_flops_per_s", "mfu_grt_medium_compiled", "mfu_dense_medium_compiled",
            "grt_over_dense_flops_per_s_compiled", "host_stall_s_grt_medium", "medium", "medium_compiled"
            } <= report.keys()
    assert report["mode"] == "cpu" and report["wall_s"] > 0 and report["complete"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(gpu_check_checks.CHECKS)
    assert all(set(c) >= {"name", "passed", "detail"} for c in report["checks"])

    step = checks["cpu_vs_device_step"]["detail"]
    assert step["initial_weights_identical"] and step["loss_after_abs_diff"] <= 1e-4
    assert "CPU too" in step["note"]

    resume = checks["kill_resume_bf16"]["detail"]
    assert resume["exit_status"] == -9 and resume["resumed_from_step"] >= 2
    assert resume["losses_equal"] and resume["bit_exact"] and resume["max_abs_diff"] == 0.0
    assert resume["nondeterminism_band"] == 0.0 and "CUBLAS_WORKSPACE_CONFIG" in resume["determinism"]
    assert checks["depth_sweep"]["detail"]["expected"] == [1, 2, 3, 4, 5, 6]

    generate = checks["hf_generate_cache"]["detail"]
    assert generate["tokens_equal"] and generate["new_tokens"] == 20
    logits = checks["hf_logits"]["detail"]
    assert logits["fp32"]["max_abs_diff"] <= 1e-4 and logits["bf16"]["max_abs_diff"] <= logits["bf16"]["tolerance"]
    cli_generate = checks["generate_cli"]["detail"]
    assert cli_generate["texts_equal"] and cli_generate["checkpoint"]["text"].startswith(cli_generate["prompt"])
    assert cli_generate["checkpoint"]["ran_on"] == cli_generate["hf"]["ran_on"] == "fp32 on cpu"

    rows = report["medium"]
    assert set(rows) == {"tiny", "tiny_dense"}
    assert all(r["median_step_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows.values())
    assert report["mfu_grt_medium"] is None and report["mfu_dense_medium"] is None
    assert report["grt_over_dense_flops_per_s"] > 0
    assert all(r["layer_spec"] == "local" and r["fusions"] == [] and r["host_stall_s"] is None  # CPU: all off
               for r in rows.values())
    compiled = report["medium_compiled"]
    # The compiled GRT once more in the baseline precision, and its step time over that baseline's.
    assert set(compiled) == {"tiny", "tiny_dense", "tiny@bf16-mixed"}
    assert compiled["tiny"]["precision"] == "bf16" and compiled["tiny@bf16-mixed"]["precision"] == "bf16-mixed"
    assert report["grt_compiled_baseline_precision"] == "bf16-mixed"
    assert report["grt_compiled_step_time_over_baseline"] == pytest.approx(
        compiled["tiny"]["median_step_s"] / compiled["tiny@bf16-mixed"]["median_step_s"])
    assert report["grt_compiled_steady_step_time_over_baseline"] > 0
    assert all(r["compiled"] and r["compiled_graphs"] >= 1 and r["first_step_s"] > r["median_step_s"]
               and all(math.isfinite(v) for v in r["losses"]) for r in compiled.values())
    # Compiling changes the speed, not the function: the first step's loss (same weights, same batch) is eager's.
    for name, row in compiled.items():
        name = name.split("@")[0]
        assert abs(row["losses"][0] - rows[name]["losses"][0]) <= 1e-2 * abs(rows[name]["losses"][0]), name
    assert report["grt_over_dense_flops_per_s_compiled"] > 0 and report["grt_over_dense_tokens_per_s_compiled"] > 0


def test_kernel_busy_time_is_the_union_of_kernel_intervals():
    from tools.bench.gpu_mfu import _busy_seconds

    assert _busy_seconds([]) == 0.0
    assert _busy_seconds([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.7)]) == 4.0  # overlaps counted once


def test_throughput_with_accumulation_counts_every_micro_batch_and_steps_once(world):
    """tools/bench/gpu_mfu.py with gradient accumulation (--medium-accumulation): a step is N micro-batches
    and one optimizer update, and its tokens and FLOPs count all N (on CPU: tiny model, fp32)."""
    from tools.bench.gpu_mfu import measure_training_step

    rows = {n: measure_training_step("tiny", batch=2, seq=32, steps=2, warmup=1, precision="fp32", vocab=256,
                                     accumulation=n) for n in (1, 3)}
    for n, row in rows.items():
        assert row["accumulation"] == n and row["optimizer_steps"] == 5  # warmup + timed + back to back
        assert row["steady_step_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 32 * n / row["median_step_s"])
        assert all(math.isfinite(v) for v in row["losses"])
    per_token = [row["model_flops_per_s"] / row["tokens_per_s"] for row in rows.values()]
    assert per_token[0] == pytest.approx(per_token[1])  # the same model FLOPs a token, N times the tokens


def test_throughput_of_bf16_mixed_runs_the_trainers_step(world):
    """`--medium-precision bf16-mixed`: fp32 weights under autocast, clipped on the device and guarded as
    grt-train's runner does; its first loss (same weights and batch) is fp32's within bf16 rounding."""
    from tools.bench.gpu_mfu import measure_training_step

    def measured(precision):
        torch.manual_seed(0)  # the batch is drawn from the global generator
        return measure_training_step("tiny", batch=2, seq=32, steps=2, warmup=1, precision=precision, vocab=256)

    rows = {p: measured(p) for p in ("fp32", "bf16-mixed")}
    mixed = rows["bf16-mixed"]
    assert mixed["precision"] == "bf16-mixed" and mixed["optimizer_steps"] == 5
    assert all(math.isfinite(v) for v in mixed["losses"])
    assert mixed["losses"][0] == pytest.approx(rows["fp32"]["losses"][0], rel=1e-3)
    assert mixed["losses"][0] != rows["fp32"]["losses"][0]  # bf16 matmuls ran
    assert mixed["losses"][-1] < mixed["losses"][0]
