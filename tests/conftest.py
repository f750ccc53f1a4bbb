"""Shared test helpers: one single-process megatron world per session, tiny configs, the CLI."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def _share_the_cores_between_workers() -> None:
    """Each pytest-xdist worker, and every process its tests start, gets cores / workers threads, as
    grt-grid gives its jobs. With torch's default (every core) in each of two workers, their OpenMP threads
    spin while waiting for cores the other worker holds: two tiny runs side by side took 37 s each with two
    threads and 12 s with one, on this suite's 2-core machine. torchrun already gives its ranks one thread.
    Set before torch is imported (its OpenMP runtime reads the variable when it loads); a value the caller
    set is kept."""
    from grt_megatron.launch.grid import threads_per_job, usable_cores  # grt-grid's rule (imports no torch)

    if "PYTEST_XDIST_WORKER_COUNT" not in os.environ:  # xdist's controller, or a run without workers
        return
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_job(usable_cores(), 0, workers)))
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    if "torch" in sys.modules:  # a plugin imported it first
        sys.modules["torch"].set_num_threads(int(threads))


_share_the_cores_between_workers()

from grt_megatron.console import quiet_known_warnings  # noqa: E402 (imports torch: after the threads are set)

quiet_known_warnings()



@pytest.fixture(autouse=True)
def _functional_linear_restored(monkeypatch):
    """`torch.nn.functional.linear` as it was before each test. Building a ZeRO 3 engine in this process
    replaces it for good with DeepSpeed's memory-efficient linear ("this will persist unless manually
    reset"), which casts under autocast at every call: a later test that counts autocast's casts then saw R
    casts of each shared weight instead of one, and failed or passed by the workers' test order."""
    import torch

    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GRT_SHARED_DATA", REPO.parent / "shared" / "data"))
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
if not SHAKESPEARE.is_file():
    raise pytest.UsageError(f"test corpus {SHAKESPEARE} not found: the tests read the project's shared data "
                            "beside the checkout (../shared/data); set GRT_SHARED_DATA to its folder")


@pytest.fixture(scope="session")
def world():
    """A world of one (gloo), megatron parallel state and seeded RNG tracker."""
    from grt_megatron.distributed import init_distributed

    return init_distributed(seed=0)


def tiny_config(parallel: dict | None = None, **overrides):
    """The tiny GRT's config with recipe `overrides`; `parallel`: from_recipe's TP/SP settings."""
    from grt_megatron.model import GRTConfig

    recipe = dict(hidden_size=64, num_attention_heads=4, vocab_size=300, max_sequence_length=32,
                  prelude_layers=1, core_layers=1, coda_layers=1, recurrences=3, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0)
    recipe.update(overrides)
    return GRTConfig.from_recipe(recipe, **(parallel or {}))


def loss_and_grads(model, tokens):
    """One forward and backward of `model` on `tokens` (next-token targets): (mean loss, {name: grad})."""
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(got, want, loss_rtol: float, grad_rtol: float, grad_atol: float) -> None:
    """Two `loss_and_grads` results agree: the loss within `loss_rtol`, every gradient within its tolerances."""
    import torch

    torch.testing.assert_close(got[0], want[0], rtol=loss_rtol, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=grad_rtol, atol=grad_atol, msg=name)


def train_config(overrides: list[str]):
    """The hydra config `grt-train OVERRIDES` composes from recipes/ (not yet validated), in this process."""
    from hydra import compose, initialize_config_dir

    from grt_megatron.training.cli import RECIPES

    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose("train", overrides=overrides)


# bf16 runs in tests use short rows: on CPUs without AVX-512 (CI's may be one) torch's bf16 matmuls take a slow
# path, 10-130x fp32's time, and what those tests check (resume, waits, the optimizers) is the same at any length.
BF16_SHORT = ["train.seq_length=32"]


def json_from_fresh_process(script: str, args: list[str], marker: str, timeout: int):
    """Run `script` (python -c, with `args`) in a process of its own, so that nothing an earlier test did in
    this one enters what it measures; the JSON it prints after `marker`."""
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split(marker)[-1])


def run_cli(args: list[str], env: dict | None = None, launcher: list[str] | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """`grt-train ARGS` in a fresh process (optionally under torchrun), as a user would run it."""
    if launcher is None:
        cmd = [sys.executable, "-m", "grt_megatron.training.cli", *args]
    else:
        cmd = [*launcher, str(REPO / "grt_megatron" / "training" / "cli.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=cli_env(env), capture_output=True, text=True, timeout=timeout)


# Set by a launcher, or exported by an in-process test's `world` (its process group holds MASTER_PORT):
# a child process must not inherit them, or it joins or re-binds that group.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli_env(extra: dict | None = None) -> dict:
    """This environment for a `grt-train` child: no launcher variables, no wandb credentials."""
    full_env = {**os.environ, **(extra or {})}
    for var in (*LAUNCHER_VARIABLES, "WANDB_API_KEY", "WANDB_MODE"):
        full_env.pop(var, None)
    return full_env


def start_cli(args: list[str]) -> subprocess.Popen:
    """`grt-train ARGS` started in the background (to be signalled or killed), output captured."""
    return subprocess.Popen([sys.executable, "-m", "grt_megatron.training.cli", *args], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, poll: float = 0.002) -> None:
    """Poll `predicate` until it holds; fail if `proc` exits first or `timeout` seconds pass."""
    start = time.perf_counter()
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.perf_counter() - start < timeout
        time.sleep(poll)


def stdout_lines(proc: subprocess.Popen) -> "queue.Queue[str]":
    """`proc`'s stdout lines as they arrive, read by a daemon thread, so a test can wait for one with a
    timeout (a plain `for line in proc.stdout` blocks for as long as the process stays quiet)."""
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def wait_for_line(lines: "queue.Queue[str]", needle: str, what: str, timeout: float = 120) -> None:
    """Wait until a line of `lines` (`stdout_lines`) contains `needle`; fail after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if needle in lines.get(timeout=0.1):
                return
        except queue.Empty:
            pass
    raise AssertionError(f"{what} never printed {needle!r}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_prepare(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`grt-prepare-data ARGS` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    return subprocess.run([sys.executable, "-m", "grt_megatron.data.prepare", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def pydoc_prefix(tmp_path_factory):
    """builtin corpus prepared with a trained 2048-piece tokenizer: (prefix, summary)."""
    from grt_megatron.data.prepare import prepare_dataset

    prefix = tmp_path_factory.mktemp("prepared") / "pydoc"
    summary = prepare_dataset(["builtin:pydoc_topics"], prefix, train_vocab_size=2048, progress=False)
    return prefix, summary
