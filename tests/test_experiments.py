"""Experiment grids: every cell recipe composes into a valid run, and `grt-grid` + `grt-report` run a
small grid end to end (restartable: finished cells return at once)."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SHAKESPEARE, read_jsonl, run_prepare
from hydra import compose, initialize_config_dir

CELLS = sorted(str(p.relative_to(REPO / "recipes/experiment").with_suffix(""))
               for p in (REPO / "recipes/experiment").glob("*/*.yaml") if p.stem != "base")


def test_every_cell_composes_into_a_valid_run():
    from grt_megatron.training.config import build_run_config

    assert len(CELLS) >= 3 * 7 + 7 + 13  # small/medium/large × 7, the CPU grid with its ablations, the probe
    dirs = set()
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        for cell in CELLS:
            cfg = build_run_config(compose("train", overrides=[f"experiment={cell}", "seed=3",
                                                                 "experiment.budget=0.5"]))
            assert cfg.experiment.name == cell, f"{cell}: experiment.name is {cfg.experiment.name}"
            base = {"cpu": 2450, "probe": 16000}.get(cell.split("/")[0], 20000)
            assert cfg.train.iters == round(base * 0.5)
            assert cfg.run.dir == f"runs/experiments/{cell}/budget0.5/seed3"
            dirs.add(cfg.run.dir)
            model = cfg.model_config(1024)
            variant = cfg.experiment.variant
            assert (model.routing == "expert_choice") == (variant == "mor"), cell
            assert (model.depth_sampler == "heavy_tail") == (variant == "heavy_tail"), cell
            assert model.is_dense == (variant == "dense"), cell
    assert len(dirs) == len(CELLS)


@pytest.mark.parametrize("scale,dense_layers", [("small", 12), ("medium", 24), ("large", 36)])
def test_paper_isoflops_cells_match_dense_depth(scale, dense_layers):
    from grt_megatron.training.config import build_run_config

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        def model(cell):
            return build_run_config(compose("train", overrides=[f"experiment={scale}/{cell}"])).model_config(50257)

        assert model("dense").depth() == dense_layers
        for variant in ("grt", "heavy_tail", "mor"):
            assert model(f"{variant}_isoflops").depth() == dense_layers  # layer executions at the trained R
            assert model(f"{variant}_isoparams").num_layers == dense_layers  # unique layers


@pytest.fixture(scope="module")
def books_1k(tmp_path_factory) -> Path:
    """The corpus the CPU cells read (data/books_1k), prepared once for the module's grids."""
    prefix = tmp_path_factory.mktemp("books") / "books_1k"
    proc = run_prepare(["--input", str(SHAKESPEARE), "--output-prefix", str(prefix), "--train-tokenizer",
                        "--vocab-size", "1024", "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    return prefix


def grid_folder(tmp_path: Path, books_1k: Path) -> dict:
    """tmp_path with the corpus the CPU cells read (a copy of `books_1k` in data/), and the environment a grid
    runs in there."""
    (tmp_path / "data").mkdir()
    for file in books_1k.parent.glob(books_1k.name + ".*"):
        shutil.copy(file, tmp_path / "data" / file.name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env["GRT_RECIPES"] = str(REPO / "recipes")
    return env


def test_grid_and_report_end_to_end(tmp_path, books_1k):
    env = grid_folder(tmp_path, books_1k)
    # A caller that is itself a rank (pytest after an in-process run, or a grid inside torchrun) passes
    # RANK and a MASTER_PORT it holds: each job must still start its own world of one.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(held.getsockname()[1]))
    def grid(*seeds):
        return [sys.executable, "-m", "grt_megatron.launch.grid", "cpu/grt_isoflops_core2", "cpu/mor_isoflops",
                "--seeds", *seeds, "--workers", "2", "--log-dir", "logs", "--",
                "train.iters=6", "train.eval_interval=3", "train.eval_iters=2", "checkpoint.interval=3"]

    proc = subprocess.run(grid("1", "2"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "grid: 4/4 runs finished" in proc.stdout
    assert "24/24" in proc.stderr  # the progress bar counts every job's steps (4 jobs × 6)
    jobs = read_jsonl(tmp_path / "logs/grid.jsonl")
    assert sorted((j["cell"], j["seed"]) for j in jobs) == [
        ("cpu/grt_isoflops_core2", 1), ("cpu/grt_isoflops_core2", 2), ("cpu/mor_isoflops", 1), ("cpu/mor_isoflops", 2)]
    run = tmp_path / "runs/experiments/cpu/mor_isoflops/budget1.0/seed2"
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["recurrences"] for r in records if r.get("split") == "depth_sweep"] == [1, 2, 3, 4]  # MoR: up to R
    # MoR is evaluated under the causal threshold (`loss`) and under training's top-k; the share of tokens
    # that ran each recursion is logged.
    evals = [r for r in records if r.get("split") == "valid"]
    assert evals and all(math.isfinite(r["loss_topk_routing"]) and r["active_fraction_r1"] == 1.0 for r in evals)
    assert all(0 <= r["active_fraction_r4"] <= 1 for r in evals)
    core2 = read_jsonl(tmp_path / "runs/experiments/cpu/grt_isoflops_core2/budget1.0/seed1/metrics.jsonl")
    assert [r["recurrences"] for r in core2 if r.get("split") == "depth_sweep"] == [1, 2, 3, 4, 5, 6]  # R + 4

    # A restarted grid resumes each finished cell at its last step: nothing is trained or logged again. (Seed 2
    # alone: each restarted job is a grt-train start, ~8 s here.)
    proc = subprocess.run(grid("2"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "grid: 2/2 runs finished" in proc.stdout
    assert read_jsonl(run / "metrics.jsonl") == records

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "grt_megatron.report", "runs/experiments", "--output", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["cell"]: r for r in json.loads((out / "summary.json").read_text())}
    assert set(rows) == {"cpu/grt_isoflops_core2", "cpu/mor_isoflops"}
    assert all(r["seeds"] == [1, 2] and r["tokens"] == 6 * 16 * 128 for r in rows.values())
    # MoR's executed FLOPs count the tokens that left; the GRT's the R each step drew.
    assert rows["cpu/mor_isoflops"]["flops_per_token_executed"] == pytest.approx(
        rows["cpu/mor_isoflops"]["flops_per_token_nominal"])
    assert rows["cpu/grt_isoflops_core2"]["flops_per_token_executed"] < rows["cpu/grt_isoflops_core2"][
        "flops_per_token_nominal"]
    assert Path(out / "loss_vs_r.png").stat().st_size > 10_000
    held.close()


def test_grid_refuses_a_bad_override_before_any_job_starts(tmp_path, capsys):
    from grt_megatron.launch import grid

    # In a fresh process: the refusal is the only line, not after megatron-core's import warnings.
    proc = subprocess.run([sys.executable, "-m", "grt_megatron.launch.grid", "cpu/dense", "cpu/grt_isoflops",
                           "--seeds", "1", "--log-dir", str(tmp_path / "logs"), "--", "train.iters=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "grt-grid: error: cpu/dense seed 1 budget 1.0: train.iters must be >= 1, got 0\n"
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written
    # A seed grt-train refuses (it was a traceback in the first job) and a --log-dir under a file (a traceback).
    (tmp_path / "afile").write_text("x")
    for argv, message in ((["--seeds", "-1"], "cpu/dense seed -1 budget 1.0: seed must be in [0, 2**32), got -1"),
                          (["--seeds", "1", "--log-dir", str(tmp_path / "afile" / "logs")],
                           f"--log-dir {tmp_path / 'afile' / 'logs'}: cannot create it (Not a directory)")):
        with pytest.raises(SystemExit) as stop:
            grid.main(["cpu/dense", *argv])
        assert stop.value.code == 2 and capsys.readouterr().err.strip() == f"grt-grid: error: {message}"


def test_grid_reads_a_runs_latest_step_from_the_end_of_its_metrics(tmp_path):
    from grt_megatron.launch.grid import latest_step

    metrics = tmp_path / "metrics.jsonl"
    assert latest_step(metrics) == 0  # not started
    rows = [{"step": i, "loss": 3.0} for i in range(1, 2001)] + [{"step": 2000, "valid_loss": 2.9}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2001, "lo')  # a line being written
    assert latest_step(metrics) == 2000


def test_grid_reports_a_stopped_run_as_stopped_not_finished(tmp_path, books_1k):
    # grt-train exits 0 after a requeue request (SIGTERM, SIGUSR1, train.exit_interval): the grid must still
    # say the run stopped at its step, exit 1, and finish it when the same command runs again.
    env = grid_folder(tmp_path, books_1k)
    grid = [sys.executable, "-m", "grt_megatron.launch.grid", "cpu/dense", "--seeds", "1", "--log-dir", "logs",
            "--", "train.iters=6", "train.eval_interval=6", "train.eval_iters=1", "checkpoint.interval=0"]
    # Another training already holds every core (a second grid, say): this grid's job gets the one thread
    # left to it, and the grid says so rather than silently running both at a fraction of their speed.
    other = start_other_training(tmp_path, threads=os.cpu_count())
    try:
        proc = subprocess.run([*grid, "train.exit_interval=3"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
    finally:
        other.kill()
        other.wait()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "grt-train process(es) already running here" in proc.stderr
    assert "this grid's jobs get 1 thread(s) each" in proc.stderr and "every run will be slower" in proc.stderr
    assert "cpu/dense seed 1 budget 1.0: stopped at step 3 of 6; the same command resumes it" in proc.stdout
    assert "grid: 0/1 runs finished, 1 stopped before train.iters (the same command resumes them)" in proc.stdout

    # Resumed alone with `--threads 1`: the job keeps to one thread though every core is free now, leaving
    # the rest to a grid started later.
    grid[grid.index("--"):grid.index("--")] = ["--threads", "1"]
    proc = subprocess.run(grid, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "grid: 1/1 runs finished in" in proc.stdout
    jobs = read_jsonl(tmp_path / "logs/grid.jsonl")
    assert [(j["outcome"], j["step"], j["iters"], j["returncode"], j["threads"]) for j in jobs] == [
        ("stopped", 3, 6, 0, 1), ("finished", 6, 6, 0, 1)]


@pytest.mark.parametrize("argv, message", [
    (["cpu/dense", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["cpu/dense", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["cpu/no_such_cell"], "no experiment recipe cpu/no_such_cell in ")])
def test_grid_refuses_bad_arguments_in_one_line(argv, message, capsys):
    from grt_megatron.launch import grid

    with pytest.raises(SystemExit) as stop:
        grid.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"grt-grid: error: {message}") and "\n" not in err


def start_other_training(folder: Path, threads: int | None) -> subprocess.Popen:
    """A process that looks to /proc exactly as a `grt-train` console script does (the interpreter running a
    file named grt-train), with OMP_NUM_THREADS set or not, that sleeps instead of training."""
    script = folder / "bin/grt-train"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([sys.executable, str(script), "experiment=cpu/dense"], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_grid_counts_the_threads_of_trainings_already_running(tmp_path):
    from grt_megatron.launch.grid import training_processes, usable_cores

    with_omp, without = start_other_training(tmp_path / "a", 3), start_other_training(tmp_path / "b", None)
    try:
        found = dict(training_processes())
    finally:
        for proc in (with_omp, without):
            proc.kill()
            proc.wait()
    assert found[with_omp.pid] == 3
    assert found[without.pid] == usable_cores()  # torch's default: a thread per core
    assert os.getpid() not in found
    assert not {with_omp.pid, without.pid} & set(dict(training_processes()))  # gone once reaped


@pytest.mark.parametrize("argv, training", [
    (["python", "-m", "grt_megatron.training.cli", "experiment=probe/dense6"], True),  # a grt-grid job
    (["/venv/bin/python", "/venv/bin/grt-train", "train=cpu"], True),  # the console script
    (["/usr/bin/python3", "-u", "-m", "grt_megatron.training.cli"], True),  # a torchrun rank
    (["python", "-X", "importtime", "-W", "ignore", "-u", "-m", "grt_megatron.training.cli"], True),
    (["python3.12", "-mgrt_megatron.training.cli", "seed=2"], True), (["/venv/bin/grt-train"], True),
    (["python", "-X", "dev", "/venv/bin/grt-train", "train=cpu"], True),
    (["python", "-c", "import grt_megatron.training.cli", "grt-train"], False),
    (["python", "/venv/bin/torchrun", "--nproc_per_node=2", "-m", "grt_megatron.training.cli"], False),
    (["python", "-m", "torch.distributed.run", "grt-train"], False),
    (["python", "/venv/bin/grt-grid", "probe/dense6"], False),
    (["python", "-m", "pytest", "tests/test_training.py"], False), ([""], False)])
def test_grid_tells_a_training_from_its_launchers(argv, training):
    from grt_megatron.launch.grid import is_training

    assert is_training([a.encode() for a in argv]) is training


def fake_process(proc: Path, pid: int, argv: list[str], threads: int) -> None:
    """A /proc/PID entry as Linux shows a process: its NUL-separated command line and environment."""
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (proc / str(pid) / "environ").write_bytes(f"HOME=/root\0OMP_NUM_THREADS={threads}\0".encode())


def test_grid_sizes_each_job_when_it_starts_counting_only_other_grids_trainings(tmp_path):
    # A grid started alone gives its job every core; once a second grid's training runs beside it, the first
    # grid's next job must get the cores that one leaves, not the count the first grid saw when it began.
    # (A /proc of its own: the machine running the tests may be training.)
    from grt_megatron.launch.grid import job_threads

    job = ["python", "-m", "grt_megatron.training.cli", "experiment=probe/dense6"]
    fake_process(tmp_path, 101, job, threads=1)  # this grid's running job
    fake_process(tmp_path, 202, job, threads=3)  # another grid's
    fake_process(tmp_path, 303, ["python", "/venv/bin/grt-grid", "probe/dense6"], threads=8)  # a launcher
    assert job_threads(cores=8, workers=1, own={101}, proc=tmp_path) == 5
    assert job_threads(cores=8, workers=2, own={101}, proc=tmp_path) == 2
    assert job_threads(cores=8, workers=1, own=set(), proc=tmp_path) == 4
    assert job_threads(cores=8, workers=1, own={101, 202}, proc=tmp_path) == 8


@pytest.mark.parametrize("cores, busy, workers, threads", [
    (2, 0, 2, 1), (2, 0, 1, 2), (2, 2, 1, 1), (2, 4, 2, 1), (16, 4, 3, 4), (16, 0, 4, 4)])
def test_grid_shares_the_free_cores_among_its_workers(cores, busy, workers, threads):
    from grt_megatron.launch.grid import threads_per_job

    assert threads_per_job(cores, busy, workers) == threads


@pytest.mark.parametrize("returncode, step, outcome", [
    (0, 6, "finished"), (0, 5, "stopped"), (143, 0, "stopped"), (130, 2, "stopped"), (1, 6, "failed"),
    (-9, 3, "failed")])  # SIGTERM / Ctrl-C during set-up end the run as stopped; a kill or an error as failed
def test_grid_job_outcome(returncode, step, outcome):
    from grt_megatron.launch.grid import job_outcome

    assert job_outcome(returncode, step, iters=6) == outcome


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_grid_stops_its_running_job_at_a_checkpoint_and_starts_no_other(tmp_path, books_1k, signum):
    # `kill <grid>` (or Ctrl-C, which reaches the jobs only through the grid: they run in their own process
    # group) is passed on: the running grt-train saves and exits, the next job never starts.
    env = grid_folder(tmp_path, books_1k)
    grid = subprocess.Popen([sys.executable, "-m", "grt_megatron.launch.grid", "cpu/dense", "--seeds", "1", "2",
                             "--log-dir", "logs", "--", "train.iters=100000", "train.log_interval=1",
                             "checkpoint.interval=0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = tmp_path / "runs/experiments/cpu/dense/budget1.0/seed1"
    from grt_megatron.launch.grid import latest_step

    deadline = time.monotonic() + 300
    while latest_step(first / "metrics.jsonl") < 2 and grid.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    grid.send_signal(signum)  # to the grid alone, not to its jobs
    out, err = grid.communicate(timeout=300)
    assert grid.returncode == 128 + signum, out + err
    [saved] = [p.name for p in (first / "checkpoints").glob("step_*")]
    step = int(saved.split("_")[1])
    assert step >= 2
    exit_note = " (exit 130)" if signum == signal.SIGINT else ""
    assert f"cpu/dense seed 1 budget 1.0: stopped at step {step} of 100000{exit_note}; the same command resumes it" \
        in out
    assert "grid: 0/2 runs finished, 1 stopped before train.iters, 1 not started (the same command resumes them)" \
        in out and out.rstrip().endswith(f"(stopped by {signal.Signals(signum).name})")
    assert not (tmp_path / "runs/experiments/cpu/dense/budget1.0/seed2/metrics.jsonl").exists()
    assert [j["outcome"] for j in read_jsonl(tmp_path / "logs/grid.jsonl")] == ["stopped"]
