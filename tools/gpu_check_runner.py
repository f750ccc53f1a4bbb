"""tools/gpu_check.py's machinery: the mode (shapes and step counts), the time guard, and subprocesses
started with the time that is left, their output logged under WORK/logs and their failures raised as
CheckFailed with the output's last lines. Nothing here knows what a check checks."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER_SCRIPT = Path(__file__).resolve().with_name("gpu_check_workers.py")
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "WANDB_API_KEY", "WANDB_MODE")


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



# ---- the report's JSON -------------------------------------------------------------------------------------------
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
    medium_accumulation: int = 1   # micro-batches per step of the throughput checks (--medium-accumulation)
    medium_precision: str = "bf16"  # the throughput checks' train.precision (--medium-precision)
    medium_baseline_precision: Optional[str] = None  # the compiled GRT again in this one (--medium-baseline-precision)

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
