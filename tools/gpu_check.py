"""One command that runs grt-megatron's real GPU paths and records what happened.

    python3 tools/gpu_check.py [--output tools/bench/results/gpu_check.json] [--work-dir DIR] [--cpu]
                               [--skip NAME ...] [--steps N]

Run from the repository root; the package need not be installed (the repository is put on sys.path and the
CLIs run as `python -m grt_megatron...`). With CUDA it checks the GPU in under 9 minutes; without it (or with
`--cpu`) it runs the same code on CPU with tiny shapes and few steps, which is how CI tests this script.
Each check passes or fails on its own, a failure does not stop the later ones, and the exit status is 1 if
any check failed. What each check proves:

  cpu_vs_device_step  one fp32 training step (forward, backward, AdamW) of the tiny GRT from the same seed
                      on CPU and on the device: identical initial weights (megatron initialises on CPU),
                      and losses before and after the step within 1e-4, TF32 off. Each side runs in its
                      own process, set up as a run on that device is (the CPU one with CUDA hidden, so
                      that init_distributed takes the CPU path: gloo and the CPU shims).
  prepare_data        grt-prepare-data trains a tokenizer and writes an indexed dataset, offline.
  train_bf16          grt-train trains the tiny GRT in bf16 (evaluations, checkpoints, depth sweep) and
                      its loss goes down.
  kill_resume_bf16    the same run SIGKILLed after its first checkpoint and resumed with resume=auto logs
                      the uninterrupted run's losses step for step (bit-exact, or the maximum difference).
  depth_sweep         the run logged validation losses at R = 1 ... R + 2.
  hf_export           grt-convert-hf exports the final checkpoint to a Hugging Face folder.
  hf_generate_cache   transformers' AutoModelForCausalLM (trust_remote_code) on the device: greedy
                      generate with use_cache=True and use_cache=False gives the same 20 tokens and scores.
  hf_logits           the exported model's logits equal the framework's on the same tokens (fp32 within
                      1e-4, as tests/test_hf_export.py; bf16 within 2e-2 × max(1, largest logit) of the
                      framework in bf16).
  medium_throughput   medium dense (24 layers) vs medium GRT (2+5×4+2), d 1024, seq 1024, bf16, through the
                      DeepSpeed engine: median step time, tokens/s, model FLOPs/s, MFU, peak memory, the
                      layer spec and fusions in effect (model/kernels.py: TE's layers where installed), and
                      the host stall (median step time minus the time some kernel ran, from one profiled
                      step). On CPU the tiny models stand in and MFU and the stall are null.
  medium_compiled     the same with train.compile's torch.compile (rows also record the compiled graphs and
                      the first, compiling, step's time).

Writes a JSON report (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grt_megatron.training.metrics import read_metrics  # noqa: E402

DEFAULT_OUTPUT = REPO / "tools" / "bench" / "results" / "gpu_check.json"
WORKER_SCRIPT = Path(__file__).resolve().with_name("gpu_check_workers.py")
# The whole script must fit in 9 minutes on an H200 (the eager checks in 8, then the compiled throughput);
# a check that would start later fails as "not run".
TIME_BUDGET_S = {"cuda": 540.0, "cpu": 600.0}
LOSS_TOLERANCE = 1e-4          # cpu_vs_device_step: absolute, on the mean loss
HF_LOGITS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}   # fp32: absolute, as tests/test_hf_export.py
# Without deterministic kernels (refused by an op that has no deterministic CUDA kernel) a CUDA run need not reproduce
# itself bit for bit; resumed losses are then accepted within this band, if a control shows that the
# run-to-run differences are the GPU's and not the resume's (see compare_loss_curves).
NONDETERMINISM_BAND = 2e-2
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "WANDB_API_KEY", "WANDB_MODE")
# The report's top-level numbers (null when their check did not run): eager, then compiled.
SUMMARY_KEYS = tuple(f"{key}{suffix}" for suffix in ("", "_compiled") for key in (
    "mfu_grt_medium", "mfu_dense_medium", "grt_over_dense_flops_per_s", "grt_over_dense_tokens_per_s",
    "host_stall_s_grt_medium", "host_stall_s_dense_medium"))
CHECKS = ("cpu_vs_device_step", "prepare_data", "train_bf16", "kill_resume_bf16", "depth_sweep", "hf_export",
          "hf_generate_cache", "hf_logits", "medium_throughput", "medium_compiled")


@dataclass(frozen=True)
class Mode:
    """Shapes and step counts: the real ones on a GPU, tiny ones that a 2-core CPU runs in ~3 minutes."""

    name: str                      # "cuda" | "cpu"
    train_iters: int               # steps of the bf16 CLI runs
    train_batch: int
    train_seq: int
    medium_models: tuple[str, str]  # (dense, GRT) recipes
    medium_seq: int
    medium_batch: int
    medium_warmup: int
    medium_steps: int
    medium_vocab: int

    @property
    def checkpoint_interval(self) -> int:
        return max(2, self.train_iters // 4)

    @property
    def eval_interval(self) -> int:
        return max(1, self.train_iters // 2)


def mode_for(cuda: bool, steps: Optional[int]) -> Mode:
    if cuda:  # the medium models with the GPT-2 vocabulary, as the README's parameter counts
        return Mode("cuda", train_iters=steps or 50, train_batch=16, train_seq=128,
                    medium_models=("medium_dense", "medium_grt_isoflops"), medium_seq=1024, medium_batch=8,
                    medium_warmup=3, medium_steps=5, medium_vocab=50257)
    return Mode("cpu", train_iters=steps or 8, train_batch=2, train_seq=32, medium_models=("tiny_dense", "tiny"),
                medium_seq=64, medium_batch=2, medium_warmup=1, medium_steps=2, medium_vocab=1024)


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


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def json_safe(value: Any) -> Any:
    """NaN and infinity are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomically(path: Path, payload: dict) -> None:
    """A reader never sees half a report: write beside it, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


# ---- running things ---------------------------------------------------------------------------------------------
class CheckFailed(Exception):
    """A check's expectation was not met; the message says which."""


class Clock:
    """The global time guard: every subprocess gets at most the time that is left."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def timeout(self, wanted_s: float) -> float:
        left = self.left()
        if left < 5:
            raise CheckFailed(f"not run: the time guard's {self.budget_s:.0f} s are spent")
        return min(wanted_s, left)


def log(clock: Clock, message: str) -> None:
    print(f"[gpu_check {clock.elapsed():6.1f}s] {message}", flush=True)


@dataclass
class Context:
    mode: Mode
    work: Path
    clock: Clock
    env: dict[str, str]
    results: dict[str, Any] = field(default_factory=dict)   # what later checks need from earlier ones
    workers_started: int = 0

    def need(self, key: str, check: str) -> Any:
        if key not in self.results:
            raise CheckFailed(f"needs {check}, which did not pass (or was skipped)")
        return self.results[key]


def child_env(cpu_only: bool, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"                  # no network on the GPU machine: never wait for the Hub
    env["HF_HOME"] = str(work / "hf_home")       # remote-code modules are copied here, not into ~
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@dataclass
class Running:
    """A started subprocess: its output goes to WORK/logs/NAME.log."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    timeout_s: float
    started: float
    result: Optional[Path] = None   # a worker's JSON

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def stop(self) -> int:
        """SIGKILL it and whatever it started (its own session), then reap it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def start_command(ctx: Context, cmd: list[str], name: str, timeout_s: float, env: Optional[dict] = None) -> Running:
    """Start `cmd` from the repository root, with at most the time the guard has left."""
    log_path = ctx.work / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timeout = ctx.clock.timeout(timeout_s)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or ctx.env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Running(name, proc, log_path, timeout, time.perf_counter())


def wait_command(running: Running) -> str:
    """Its output; a non-zero exit or a timeout raises CheckFailed with the output's last lines."""
    try:
        status = running.proc.wait(timeout=max(0.0, running.timeout_s - (time.perf_counter() - running.started)))
    except subprocess.TimeoutExpired:
        running.stop()
        raise CheckFailed(f"{running.name}: timed out after {running.timeout_s:.0f} s\n{tail(running.output())}")
    if status != 0:
        raise CheckFailed(f"{running.name}: exit status {status}\n{tail(running.output())}")
    return running.output()


def run_command(ctx: Context, cmd: list[str], name: str, timeout_s: float, env: Optional[dict] = None) -> str:
    return wait_command(start_command(ctx, cmd, name, timeout_s, env))


def start_worker(ctx: Context, worker: str, args: list[str], timeout_s: float, cpu_only: bool = False) -> Running:
    """A measurement of tools/gpu_check_workers.py in a fresh process: a CUDA error or OOM cannot poison
    later checks, and each model's peak memory is its own. The worker writes its result as JSON."""
    ctx.workers_started += 1
    result = ctx.work / "workers" / f"{ctx.workers_started}-{worker}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    env = child_env(cpu_only or ctx.mode.name == "cpu", ctx.work)
    running = start_command(ctx, [sys.executable, str(WORKER_SCRIPT), worker, "--result", str(result), *args],
                            f"worker-{result.stem}", timeout_s, env)
    running.result = result
    return running


def wait_worker(running: Running) -> dict:
    wait_command(running)
    return json.loads(running.result.read_text())


def run_worker(ctx: Context, worker: str, args: list[str], timeout_s: float) -> dict:
    return wait_worker(start_worker(ctx, worker, args, timeout_s))


def cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


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


def train_args(ctx: Context, run_dir: Path, *extra: str) -> list[str]:
    m = ctx.mode
    return cli("grt_megatron.training.cli", "model=tiny", "train=cpu", "train.precision=bf16",
               f"data={ctx.need('corpus', 'prepare_data')}", f"train.iters={m.train_iters}",
               f"train.global_batch_size={m.train_batch}", f"train.micro_batch_size={m.train_batch}",
               f"train.seq_length={m.train_seq}", f"train.eval_interval={m.eval_interval}", "train.eval_iters=2",
               f"checkpoint.interval={m.checkpoint_interval}", *train_overrides(ctx), "logging.wandb=disabled",
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
    if precision != "bf16":
        problems.append(f"run_info says precision {precision}")
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


# ---- (c) medium throughput --------------------------------------------------------------------------------------
def measure_medium(ctx: Context, compiled: bool) -> tuple[bool, dict, str]:
    m = ctx.mode
    suffix = "_compiled" if compiled else ""
    rows, errors = {}, {}
    for model in m.medium_models:  # one after the other: a step time measured alone
        try:
            rows[model] = run_worker(ctx, "throughput", [
                "--model", model, "--seq", str(m.medium_seq), "--batch", str(m.medium_batch), "--warmup",
                str(m.medium_warmup), "--timed-steps", str(m.medium_steps), "--vocab", str(m.medium_vocab),
                *(["--compile"] if compiled else [])], 300 if compiled else 240)
        except CheckFailed as err:  # the other model is still measured
            errors[model] = str(err)
    ctx.results["medium" + suffix] = rows
    dense, grt = (rows.get(name) for name in m.medium_models)
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

    def fmt(r):
        mfu = "MFU n/a" if r["mfu"] is None else f"MFU {r['mfu']:.1%}"
        stall = "" if r["host_stall_s"] is None else f", host stall {r['host_stall_s'] * 1e3:.1f} ms"
        return f"{r['model']} {r['median_step_s'] * 1e3:.0f} ms/step, {r['tokens_per_s']:,.0f} tok/s, {mfu}{stall}"

    summary = "; ".join([fmt(r) for r in rows.values()] + [f"{name} FAILED" for name in errors])
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
    "medium_throughput": check_medium_throughput, "medium_compiled": check_medium_compiled,
}


def run_check(ctx: Context, name: str) -> dict:
    log(ctx.clock, f"start {name}")
    start = time.perf_counter()
    try:
        passed, detail, summary = CHECK_FUNCTIONS[name](ctx)
    except CheckFailed as err:
        lines = str(err).splitlines()
        # The line that names the error, not a warning printed after it (NCCL's at exit, say).
        errors = [line for line in lines[1:] if re.search(r"\w(Error|Exception)\b|^\s*error:", line)]
        last = errors[-1] if errors else lines[-1]
        passed, detail, summary = False, {"error": str(err)}, " ... ".join(dict.fromkeys([lines[0], last]))
    except Exception:  # noqa: BLE001 — a broken check is recorded, and the next one runs
        error = tail(traceback.format_exc(), 15)
        passed, detail, summary = False, {"error": error}, error.splitlines()[-1]
    seconds = time.perf_counter() - start
    log(ctx.clock, f"{'PASS' if passed else 'FAIL'} {name} ({seconds:.1f} s): {summary}")
    return {"name": name, "passed": bool(passed), "wall_s": round(seconds, 2), "summary": summary, "detail": detail}


# ---- the report --------------------------------------------------------------------------------------------------
def device_description(mode: Mode) -> str:
    import torch

    if mode.name == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpu_check on {report['device']} ({report['mode']} mode, {report['wall_s']:.0f} s)")
    for column in ("check", "result", "s", "summary"):
        table.add_column(column, overflow="fold")
    for check in report["checks"]:
        carried = f" (carried from {check['carried_from']['date'][:10]})" if "carried_from" in check else ""
        table.add_row(check["name"], "[green]pass[/]" if check["passed"] else "[red]FAIL[/]", f"{check['wall_s']:.0f}",
                      check["summary"] + carried)
    Console(width=160).print(table)


def carried_checks(path: Optional[Path], skipped: list[str], mode: str) -> dict[str, dict]:
    """The skipped checks' entries of an earlier report of the same mode, each marked with the date, torch and
    device it ran with."""
    if path is None:
        return {}
    try:
        earlier = json.loads(path.read_text())
        if earlier["mode"] != mode:
            raise SystemExit(f"error: --previous {path}: a {earlier['mode']}-mode report; this run is {mode} mode")
        return {c["name"]: {**c, "carried_from": {"date": earlier["date"], "torch": earlier["torch"],
                                                  "device": earlier["device"]}}
                for c in earlier["checks"] if c["name"] in skipped}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: --previous {path}: not a gpu_check report ({type(err).__name__}: {err})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder, removed after")
    parser.add_argument("--cpu", action="store_true", help="CPU mode even if CUDA is available")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, metavar="NAME",
                        help=f"skip a check (repeatable): {', '.join(CHECKS)}")
    parser.add_argument("--steps", type=int, default=None, help="steps of the bf16 CLI runs (default 50; CPU 8)")
    parser.add_argument("--previous", type=Path, default=None,
                        help="an earlier report of this machine: the checks skipped now are carried from it, "
                             "marked with its date (to rerun only what failed when device time is short)")
    parser.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a grt-train override for the CLI runs (repeatable), e.g. train.fused_adam=true to "
                             "check an option on the device before it becomes a default")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all checks (default 540 on CUDA, 600 on CPU); a check that would start "
                             "after it fails as 'not run'")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 6:
        parser.error("--steps must be >= 6 (the killed run needs steps after its first checkpoint)")

    import torch

    mode = mode_for(torch.cuda.is_available() and not args.cpu, args.steps)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    for sub in ("corpus", "runs", "hf", "hf_home", "logs", "workers"):  # only our own folders, from a last run
        shutil.rmtree(work / sub, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget or TIME_BUDGET_S[mode.name])
    ctx = Context(mode=mode, work=work, clock=clock, env=child_env(mode.name == "cpu", work))
    ctx.results["medium_summary"] = {}
    ctx.results["train_overrides"] = [*TRAIN_OVERRIDES, *args.train_override]
    log(clock, f"{mode.name} mode, work dir {work}, report {args.output}")

    def report(checks: list[dict], complete: bool) -> dict:
        summary = ctx.results.get("medium_summary", {})
        return {
            "device": device_description(mode), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode.name, "wall_s": round(clock.elapsed(), 1),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "complete": complete,
            "checks": checks, "skipped": list(args.skip), "train_overrides": args.train_override,
            **{key: summary.get(key) for key in SUMMARY_KEYS},
            "medium": ctx.results.get("medium", {}), "medium_compiled": ctx.results.get("medium_compiled", {}),
        }

    previous = carried_checks(args.previous, args.skip, mode.name)
    checks = []
    for name in CHECKS:
        if name in args.skip:
            if name in previous:
                checks.append(previous[name])
                log(clock, f"carried {name} from {args.previous}: {'PASS' if previous[name]['passed'] else 'FAIL'}")
            continue
        checks.append(run_check(ctx, name))
        # After every check: a run stopped from outside (a lease running out) still leaves what it measured.
        write_json_atomically(args.output, report(checks, complete=False))
    final = report(checks, complete=True)
    write_json_atomically(args.output, final)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print_table(final)
    failed = [c["name"] for c in checks if not c["passed"]]  # carried ones included: the report is one table
    log(clock, f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; failed: {', '.join(failed)}"
                                                                            if failed else "") + f"; {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
