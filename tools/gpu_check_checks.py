"""The checks of tools/gpu_check.py, in the order they run: each takes the Context and returns (passed,
detail, one-line summary), or raises CheckFailed. Later checks take what earlier ones left in ctx.results
(the corpus, the reference run, the exported folder)."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from grt_megatron.training.metrics import read_metrics
from tools.gpu_check_runner import (REPO, CheckFailed, Context, cli, run_command, run_worker, start_command, start_worker,
                                    tail, wait_worker)

LOSS_TOLERANCE = 1e-4          # cpu_vs_device_step: absolute, on the mean loss
HF_LOGITS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}   # fp32: absolute, as tests/test_hf_export.py
# Without deterministic kernels (refused by an op that has no deterministic CUDA kernel) a CUDA run need not reproduce
# itself bit for bit; resumed losses are then accepted within this band, if a control shows that the
# run-to-run differences are the GPU's and not the resume's (see compare_loss_curves).
NONDETERMINISM_BAND = 2e-2
# generate_cli runs last: where the time guard runs out, the throughput measurements come first.
CHECKS = ("cpu_vs_device_step", "prepare_data", "train_bf16", "kill_resume_bf16", "depth_sweep", "hf_export",
          "hf_generate_cache", "hf_logits", "medium_throughput", "medium_compiled", "generate_cli")


# ---- small pure helpers (unit-tested) -------------------------------------------------------------------------
def logits_tolerance(precision: str, max_abs_logit: float) -> float:
    """fp32: absolute. bf16 keeps 8 significant bits: one bf16 step of a logit between 4 and 8 is 0.03,
    so the tolerance scales with the largest logit (2e-2 absolute for logits up to 1)."""
    if precision == "fp32":
        return HF_LOGITS_TOLERANCE["fp32"]
    return HF_LOGITS_TOLERANCE[precision] * max(1.0, max_abs_logit)


def train_losses(records: list[dict]) -> dict[int, float]:
    """step -> training loss, from metrics.jsonl records (evaluations carry a "split")."""
    return {r["step"]: r["loss"] for r in records if "split" not in r}


def compare_loss_curves(reference: dict[int, float], resumed: dict[int, float], resumed_from: int) -> dict:
    """Losses of an uninterrupted run vs a killed-and-resumed one. Steps <= `resumed_from` were logged by
    the killed process (no resume involved): they are the control for run-to-run nondeterminism; later
    steps were computed after loading the checkpoint."""
    steps = sorted(reference)
    diffs = {s: abs(reference[s] - resumed[s]) for s in steps if s in resumed}
    before = [d for s, d in diffs.items() if s <= resumed_from]
    after = [d for s, d in diffs.items() if s > resumed_from]
    mismatched = [s for s in steps if s not in resumed or reference[s] != resumed[s]]
    return {
        "same_steps": sorted(resumed) == steps,
        "bit_exact": sorted(resumed) == steps and not mismatched,
        "max_abs_diff": max(diffs.values(), default=math.inf),
        "control_max_abs_diff": max(before, default=0.0),
        "after_resume_max_abs_diff": max(after, default=0.0),
        "first_mismatch_step": mismatched[0] if mismatched else None,
    }


def resume_passed(comparison: dict, mode: str, deterministic: bool) -> bool:
    """Bit-exact, or, on a GPU without deterministic kernels, within the band when the control (no
    resume) differs too, so that the difference is the kernels' and not the checkpoint's."""
    if comparison["bit_exact"]:
        return True
    return (mode == "cuda" and not deterministic and comparison["same_steps"]
            and comparison["control_max_abs_diff"] > 0 and comparison["max_abs_diff"] <= NONDETERMINISM_BAND)


# ---- (a) one step on CPU and on the device ----------------------------------------------------------------------
def check_cpu_vs_device_step(ctx: Context) -> tuple[bool, dict, str]:
    # Both at once: they share no state, and the CPU side is the slow one.
    cpu_run = start_worker(ctx, "step", ["--tensors", str(ctx.work / "step-cpu.pt")], 240, cpu_only=True)
    try:
        device_run = start_worker(ctx, "step", ["--tensors", str(ctx.work / "step-device.pt")], 240)
        try:
            cpu, device = wait_worker(cpu_run), wait_worker(device_run)
        finally:
            device_run.stop()
    finally:
        cpu_run.stop()
    import torch

    a = torch.load(ctx.work / "step-cpu.pt", weights_only=True)
    b = torch.load(ctx.work / "step-device.pt", weights_only=True)
    same_init = a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    logits_diff = float((a["logits"] - b["logits"]).abs().max())
    before = abs(cpu["loss_before"] - device["loss_before"])
    after = abs(cpu["loss_after"] - device["loss_after"])
    detail = {
        "reference": cpu["device"], "device": device["device"],
        "note": "CPU mode: the 'device' is the CPU too" if ctx.mode.name == "cpu" else
                "TF32 off on the device (matmul and cuDNN)",
        "model": cpu["model"], "noise": "off: CPU and CUDA generators draw different noise from one seed",
        "initial_weights_identical": same_init, "tensors_compared": len(a["weights"]),
        "logits_max_abs_diff": logits_diff,
        "loss_before": [cpu["loss_before"], device["loss_before"]], "loss_before_abs_diff": before,
        "loss_after": [cpu["loss_after"], device["loss_after"]], "loss_after_abs_diff": after,
        "grad_norm": [cpu["grad_norm"], device["grad_norm"]], "tolerance": LOSS_TOLERANCE,
    }
    passed = same_init and before <= LOSS_TOLERANCE and after <= LOSS_TOLERANCE
    return passed, detail, (f"weights {'identical' if same_init else 'DIFFER'}; loss diff before {before:.1e}, "
                            f"after {after:.1e}; logits max diff {logits_diff:.1e}")


# ---- (b) the CLI: data, bf16 training, kill + resume, depth sweep, HF export ------------------------------------
def train_env(ctx: Context) -> dict[str, str]:
    # Deterministic cuBLAS reductions, for a bit-exact resume; only for these runs, since it limits
    # cuBLAS's workspace (and so could slow the throughput measurement).
    return {**ctx.env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# The depth sweep, and deterministic kernels for a bit-exact resume (dropped if an op refuses them).
TRAIN_OVERRIDES = ("train.depth_sweep=2", "train.deterministic=true")


def train_overrides(ctx: Context) -> list[str]:
    return ctx.results.setdefault("train_overrides", list(TRAIN_OVERRIDES))


def deterministic_kernels(ctx: Context) -> bool:
    return "train.deterministic=true" in train_overrides(ctx)


def determinism_note(ctx: Context) -> str:
    if deterministic_kernels(ctx):
        return "train.deterministic=true (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8)"
    return "CUBLAS_WORKSPACE_CONFIG=:4096:8 only: deterministic kernels were refused by an op"


def train_precision(ctx: Context) -> str:
    """The CLI runs' precision: bf16, or what a `--train-override train.precision=...` asks for (e.g.
    bf16-mixed, to run it through training and the kill/resume on the device)."""
    asked = [o.split("=", 1)[1] for o in train_overrides(ctx) if o.startswith("train.precision=")]
    return asked[-1] if asked else "bf16"


def train_args(ctx: Context, run_dir: Path, *extra: str) -> list[str]:
    m = ctx.mode
    overrides = [o for o in train_overrides(ctx) if not o.startswith("train.precision=")]
    return cli("grt_megatron.training.cli", "model=tiny", "train=cpu", f"train.precision={train_precision(ctx)}",
               f"data={ctx.need('corpus', 'prepare_data')}", f"train.iters={m.train_iters}",
               f"train.global_batch_size={m.train_batch}", f"train.micro_batch_size={m.train_batch}",
               f"train.seq_length={m.train_seq}", f"train.eval_interval={m.eval_interval}", "train.eval_iters=2",
               f"checkpoint.interval={m.checkpoint_interval}", *overrides, "logging.wandb=disabled",
               "logging.progress=false", f"run.dir={run_dir}", *extra)


def check_prepare_data(ctx: Context) -> tuple[bool, dict, str]:
    prefix = ctx.work / "corpus" / "pydoc"
    out = run_command(ctx, cli("grt_megatron.data.prepare", "--input", "builtin:pydoc_topics", "--output-prefix",
                               str(prefix), "--train-tokenizer", "--vocab-size", "1024", "--no-progress"),
                      "prepare", 180)
    meta = json.loads(prefix.with_name(prefix.name + ".meta.json").read_text())
    files = {s: prefix.with_name(prefix.name + s).is_file() for s in (".bin", ".idx", ".tokenizer.model")}
    ctx.results["corpus"] = str(prefix)
    summary = tail(out, 1)
    return all(files.values()), {"prefix": str(prefix), "files": files, "meta": meta, "output": summary}, summary


def train_uninterrupted(ctx: Context, run_dir: Path) -> tuple[str, Optional[str]]:
    """The reference run. If deterministic kernels are refused (an op without a deterministic CUDA kernel
    raises), that is recorded and the run repeated without them, so that the checks after it still run."""
    try:
        return run_command(ctx, train_args(ctx, run_dir), "train-uninterrupted", 240, train_env(ctx)), None
    except CheckFailed as err:
        # torch's words: "... does not have a deterministic implementation, but you set
        # 'torch.use_deterministic_algorithms(True)'"
        refusals = [line for line in str(err).splitlines()
                    if "deterministic implementation" in line or "use_deterministic_algorithms" in line]
        if not (refusals and deterministic_kernels(ctx)):
            raise
        refused = refusals[-1]
    ctx.results["train_overrides"] = [o for o in train_overrides(ctx) if o != "train.deterministic=true"]
    shutil.rmtree(run_dir)
    return run_command(ctx, train_args(ctx, run_dir), "train-uninterrupted-2", 240, train_env(ctx)), refused


def check_train_bf16(ctx: Context) -> tuple[bool, dict, str]:
    run_dir = ctx.work / "runs" / "uninterrupted"
    start = time.perf_counter()
    out, deterministic_refused = train_uninterrupted(ctx, run_dir)
    seconds = time.perf_counter() - start
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = train_losses(records)
    valid = [r for r in records if r.get("split") == "valid"]
    iters = ctx.mode.train_iters
    final = run_dir / "checkpoints" / f"step_{iters:08d}"
    precision = json.loads((run_dir / "run_info.json").read_text())["config"]["train"]["precision"]
    problems = []
    if sorted(losses) != list(range(1, iters + 1)):
        problems.append(f"train records for steps {sorted(losses)}, not 1..{iters}")
    if not all(math.isfinite(v) for v in losses.values()):
        problems.append("a non-finite training loss")
    if not valid or valid[-1]["step"] != iters:
        problems.append("no validation record at the last step")
    if losses and losses.get(iters, math.inf) >= losses.get(1, -math.inf):
        problems.append("the training loss did not go down")
    if not final.is_dir():
        problems.append(f"no final checkpoint {final.name}")
    if precision != train_precision(ctx):
        problems.append(f"run_info says precision {precision}, not {train_precision(ctx)}")
    if not problems:
        ctx.results.update(reference=losses, reference_dir=run_dir, final_checkpoint=final, records=records)
    detail = {"run_dir": str(run_dir), "steps": iters, "seconds": seconds, "precision": precision,
              "first_loss": losses.get(1), "final_loss": losses.get(iters),
              "valid": [(r["step"], r["loss"]) for r in valid],
              "step_seconds_median": statistics.median(r["step_seconds"] for r in records if "split" not in r),
              "problems": problems, "deterministic_refused": deterministic_refused, "overrides": train_overrides(ctx),
              "output": tail(out, 3)}
    notes = problems + ([f"train.deterministic refused, ran without: {deterministic_refused}"]
                        if deterministic_refused else [])
    return not problems, detail, (f"{iters} steps in {seconds:.0f} s, loss {losses.get(1, math.nan):.3f} -> "
                                  f"{losses.get(iters, math.nan):.3f}" + "".join(f"; {n}" for n in notes))


def start_and_kill_after_first_checkpoint(ctx: Context, run_dir: Path, timeout_s: float) -> dict:
    """Start the run, SIGKILL it as soon as its first checkpoint is complete (a save renames .tmp-step_N to
    step_N only when every file is written), as a crash or a lost node would."""
    running = start_command(ctx, train_args(ctx, run_dir), "train-killed", timeout_s, train_env(ctx))
    checkpoints, found = run_dir / "checkpoints", []
    while running.proc.poll() is None and time.perf_counter() - running.started < running.timeout_s:
        found = sorted(p.name for p in checkpoints.glob("step_*")) if checkpoints.is_dir() else []
        if found:
            break
        time.sleep(0.01)
    if running.proc.poll() is not None:
        raise CheckFailed(f"the run ended (exit {running.proc.returncode}) before it could be killed; "
                          f"checkpoints {found}\n{tail(running.output())}")
    status = running.stop()
    if not found:
        raise CheckFailed(f"no checkpoint within {running.timeout_s:.0f} s\n{tail(running.output())}")
    logged = train_losses(read_metrics(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else {}
    return {"killed_after": found[0], "exit_status": status, "steps_logged_before_kill": max(logged, default=0)}


def check_kill_resume_bf16(ctx: Context) -> tuple[bool, dict, str]:
    reference = ctx.need("reference", "train_bf16")
    run_dir = ctx.work / "runs" / "killed"
    killed = start_and_kill_after_first_checkpoint(ctx, run_dir, 240)
    out = run_command(ctx, train_args(ctx, run_dir, "resume=auto"), "train-resumed", 240, train_env(ctx))
    match = re.search(r"resumed from (\S+) at step (\d+)", out)
    if not match:
        raise CheckFailed(f"the resumed run does not say where it resumed from\n{tail(out)}")
    resumed_from = int(match.group(2))
    comparison = compare_loss_curves(reference, train_losses(read_metrics(run_dir / "metrics.jsonl")), resumed_from)
    passed = killed["exit_status"] == -signal.SIGKILL and resume_passed(comparison, ctx.mode.name,
                                                                        deterministic_kernels(ctx))
    detail = {**killed, "resumed_from_step": resumed_from, "resumed_from": match.group(1), **comparison,
              "losses_equal": comparison["bit_exact"],
              "determinism": determinism_note(ctx),
              "nondeterminism_band": 0.0 if ctx.mode.name == "cpu" or deterministic_kernels(ctx) else
                                     NONDETERMINISM_BAND}
    exact = "bit-exact" if comparison["bit_exact"] else f"max diff {comparison['max_abs_diff']:.2e}"
    return passed, detail, f"killed after {killed['killed_after']}, resumed at step {resumed_from}: losses {exact}"


def check_depth_sweep(ctx: Context) -> tuple[bool, dict, str]:
    records = ctx.need("records", "train_bf16")
    run_info = json.loads((ctx.results["reference_dir"] / "run_info.json").read_text())
    r = run_info["model"]["recurrences"]
    sweep = {rec["recurrences"]: rec["loss"] for rec in records if rec.get("split") == "depth_sweep"}
    want = list(range(1, r + 3))
    passed = sorted(sweep) == want and all(math.isfinite(v) for v in sweep.values())
    return passed, {"trained_recurrences": r, "expected": want, "losses": sweep}, \
        f"R = {', '.join(map(str, sorted(sweep)))} logged (trained R = {r})"


def check_hf_export(ctx: Context) -> tuple[bool, dict, str]:
    checkpoint = ctx.need("final_checkpoint", "train_bf16")
    folder = ctx.work / "hf"
    out = run_command(ctx, cli("grt_megatron.hf.convert", "--checkpoint", str(checkpoint), "--output", str(folder)),
                      "hf-export", 180)
    files = sorted(p.name for p in folder.iterdir())
    needed = {"config.json", "configuration_grt.py", "modeling_grt.py", "model.safetensors", "tokenizer.model"}
    passed = needed <= set(files)
    if passed:
        ctx.results["hf_dir"] = folder
    return passed, {"folder": str(folder), "files": files, "missing": sorted(needed - set(files)),
                    "output": tail(out, 1)}, f"{len(files)} files in {folder.name}/"


def hf_results(ctx: Context) -> dict:
    """One device worker for both HF checks (loading transformers and the models once)."""
    if "hf" not in ctx.results:
        try:
            ctx.results["hf"] = run_worker(ctx, "hf", [
                "--checkpoint", str(ctx.need("final_checkpoint", "train_bf16")),
                "--hf-dir", str(ctx.need("hf_dir", "hf_export"))], 300)
        except CheckFailed as err:
            ctx.results["hf"] = err  # the second check reports the same failure instead of running it again
    if isinstance(ctx.results["hf"], CheckFailed):
        raise ctx.results["hf"]
    return ctx.results["hf"]


def check_hf_generate_cache(ctx: Context) -> tuple[bool, dict, str]:
    gen = hf_results(ctx)["generate"]
    passed = gen["tokens_equal"] and gen["scores_max_abs_diff"] <= HF_LOGITS_TOLERANCE["fp32"]
    return passed, gen, (f"{gen['new_tokens']} tokens {'identical' if gen['tokens_equal'] else 'DIFFER'} with and "
                         f"without cache ({gen['distinct_new_tokens']} distinct); scores max diff "
                         f"{gen['scores_max_abs_diff']:.1e}")


def check_hf_logits(ctx: Context) -> tuple[bool, dict, str]:
    rows = hf_results(ctx)["logits"]
    for precision, row in rows.items():
        row["tolerance"] = logits_tolerance(precision, row["max_abs_logit"])
    passed = all(row["max_abs_diff"] <= row["tolerance"] for row in rows.values())
    return passed, rows, "; ".join(f"{p} max diff {row['max_abs_diff']:.1e} (tolerance {row['tolerance']:.0e})"
                                   for p, row in rows.items())


GENERATE_PROMPT = "def main():\n    "


def run_generate(ctx: Context, source: list[str]) -> dict:
    """grt-generate as a user runs it (no --device: CUDA where there is one), greedy; its text (stdout) and the
    device line it printed (stderr) kept apart."""
    cmd = cli("grt_megatron.generation", *source, "--prompt", GENERATE_PROMPT, "--max-new-tokens", "20", "--greedy")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ctx.env, capture_output=True, text=True,
                              timeout=ctx.clock.timeout(120))
    except subprocess.TimeoutExpired as err:
        raise CheckFailed(f"grt-generate {source[0]}: timed out after {err.timeout:.0f} s") from None
    if proc.returncode != 0:
        raise CheckFailed(f"grt-generate {source[0]}: exit status {proc.returncode}\n{tail(proc.stderr)}")
    ran_on = [line for line in proc.stderr.splitlines() if line.startswith("grt-generate: ") and " on " in line]
    return {"text": proc.stdout, "ran_on": ran_on[0].removeprefix("grt-generate: ") if ran_on else None,
            "seconds": round(time.perf_counter() - start, 2)}


def check_generate_cli(ctx: Context) -> tuple[bool, dict, str]:
    """grt-generate from the checkpoint (grt-megatron's model, built on the host and moved) and from the export
    (transformers, with its cache), both on the device by default: the same greedy text."""
    checkpoint = run_generate(ctx, ["--checkpoint", str(ctx.need("final_checkpoint", "train_bf16"))])
    exported = run_generate(ctx, ["--hf", str(ctx.need("hf_dir", "hf_export"))])
    device = "cuda" if ctx.mode.name == "cuda" else "cpu"
    on_device = all((r["ran_on"] or "").startswith(f"fp32 on {device}") for r in (checkpoint, exported))  # cuda:0
    same = checkpoint["text"] == exported["text"]
    detail = {"prompt": GENERATE_PROMPT, "checkpoint": checkpoint, "hf": exported, "texts_equal": same,
              "expected_device": device}
    return same and on_device, detail, (f"--checkpoint ({checkpoint['ran_on']}, {checkpoint['seconds']:.0f} s) and "
                                        f"--hf ({exported['ran_on']}, {exported['seconds']:.0f} s): greedy texts "
                                        f"{'identical' if same else 'DIFFER'}")


# ---- (c) medium throughput --------------------------------------------------------------------------------------
def measure_medium(ctx: Context, compiled: bool) -> tuple[bool, dict, str]:
    m = ctx.mode
    suffix = "_compiled" if compiled else ""
    # One after the other: a step time measured alone. Compiled, with --medium-baseline-precision, the GRT
    # once more in that precision on the same card (row "<model>@<precision>"): which precision is faster.
    runs = [(model, model, ctx.medium_precision) for model in m.medium_models]
    baseline = ctx.medium_baseline_precision if compiled else None
    if baseline:
        runs.append((f"{m.medium_models[1]}@{baseline}", m.medium_models[1], baseline))
    rows, errors = {}, {}
    for key, model, precision in runs:
        try:
            rows[key] = run_worker(ctx, "throughput", [
                "--model", model, "--seq", str(m.medium_seq), "--batch", str(m.medium_batch), "--warmup",
                str(m.medium_warmup), "--timed-steps", str(m.medium_steps), "--vocab", str(m.medium_vocab),
                "--accumulation", str(ctx.medium_accumulation), "--precision", precision,
                *(["--compile"] if compiled else [])],
                300 if compiled else 240)
        except CheckFailed as err:  # the other model is still measured
            errors[key] = str(err)
    ctx.results["medium" + suffix] = rows
    dense, grt = (rows.get(name) for name in m.medium_models)
    if baseline:
        base = rows.get(runs[-1][0])
        ctx.results["medium_summary"].update({
            "grt_compiled_baseline_precision": baseline,
            "grt_compiled_step_time_over_baseline": grt["median_step_s"] / base["median_step_s"]
            if grt and base else None,
            "grt_compiled_steady_step_time_over_baseline": grt["steady_step_s"] / base["steady_step_s"]
            if grt and base else None})
    both = bool(dense and grt)
    ratio = grt["model_flops_per_s"] / dense["model_flops_per_s"] if both else None
    ctx.results["medium_summary"].update({
        f"mfu_grt_medium{suffix}": grt and grt["mfu"], f"mfu_dense_medium{suffix}": dense and dense["mfu"],
        f"grt_over_dense_flops_per_s{suffix}": ratio,
        f"grt_over_dense_tokens_per_s{suffix}": grt["tokens_per_s"] / dense["tokens_per_s"] if both else None,
        f"host_stall_s_grt_medium{suffix}": grt and grt["host_stall_s"],
        f"host_stall_s_dense_medium{suffix}": dense and dense["host_stall_s"]})
    passed = not errors and all(r["median_step_s"] > 0 and r["losses_finite"] for r in rows.values())
    if m.name == "cuda":  # a GPU whose bf16 peak is unknown gives no MFU: say so by failing
        passed = passed and all(r["mfu"] is not None for r in rows.values())

    def fmt(key, r):
        mfu = "MFU n/a" if r["mfu"] is None else f"MFU {r['mfu']:.1%} (back to back {r['steady_mfu']:.1%})"
        stall = "" if r["host_stall_s"] is None else f", host stall {r['host_stall_s'] * 1e3:.1f} ms"
        return f"{key} {r['median_step_s'] * 1e3:.0f} ms/step, {r['tokens_per_s']:,.0f} tok/s, {mfu}{stall}"

    summary = "; ".join([fmt(key, r) for key, r in rows.items()] + [f"{name} FAILED" for name in errors])
    return passed, {"rows": rows, "errors": errors, f"grt_over_dense_flops_per_s{suffix}": ratio}, summary


def check_medium_throughput(ctx: Context) -> tuple[bool, dict, str]:
    return measure_medium(ctx, compiled=False)


def check_medium_compiled(ctx: Context) -> tuple[bool, dict, str]:
    """The same, with train.compile's torch.compile (each row records its compiled graphs and first step)."""
    return measure_medium(ctx, compiled=True)


CHECK_FUNCTIONS: dict[str, Callable[[Context], tuple[bool, dict, str]]] = {
    "cpu_vs_device_step": check_cpu_vs_device_step, "prepare_data": check_prepare_data,
    "train_bf16": check_train_bf16, "kill_resume_bf16": check_kill_resume_bf16, "depth_sweep": check_depth_sweep,
    "hf_export": check_hf_export, "hf_generate_cache": check_hf_generate_cache, "hf_logits": check_hf_logits,
    "generate_cli": check_generate_cli,
    "medium_throughput": check_medium_throughput, "medium_compiled": check_medium_compiled,
}
