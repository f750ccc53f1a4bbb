"""`grt-grid`: run cells of an experiment grid (`recipes/experiment/`) on one machine, a few at a time.

    grt-grid cpu/dense cpu/grt_isoflops --seeds 1 2 --workers 2 [-- hydra overrides for every job]

Each job is `grt-train experiment=CELL seed=S experiment.budget=B resume=auto [overrides]` in its own process
with `OMP_NUM_THREADS = cores / workers` (on a small CPU, two one-thread runs train ~1.3× more tokens per
second in all than one two-thread run). The cores are those that other grt-train processes running here when
the job starts (another grid's, say) leave free, and a grid started beside a training warns: two grids of
`--workers 1` on 2 cores gave each run 2 threads, and each trained ~8× slower than in one grid of
`--workers 2`. A job already running keeps its threads; the next one is sized anew. `--threads N` fixes each
job's threads instead, for a grid that should leave cores to one started later (a lone `--workers 1` grid on a
shared machine, say, that would otherwise take every core). `resume=auto` makes the
grid restartable: a killed grid continues each cell from its last checkpoint, and a finished cell returns at once.
Jobs are taken cell by cell, so the seeds of a cell finish together. Every job's configuration is composed
before any starts (a recipe or override that does not compose is refused at once, in one line), and the
progress bar counts the steps of all jobs together, read from each run's metrics.jsonl. On a cluster, submit
cells with `grt-submit` or hydra multirun instead (`grt-train -m experiment=small/dense,small/grt_isoflops
seed=1,2,3`).

A job counts as finished only when its metrics reach train.iters. One that a signal or train.exit_interval
stopped earlier exits 0 for a requeue, but here it is reported as stopped at its step, not as done; the grid
then exits 1, so `grt-grid ... && grt-report ...` never reports a half-trained grid as a finished one.
SIGINT (Ctrl-C), SIGTERM or SIGHUP to the grid is passed on to the jobs running (SIGHUP as SIGTERM): each
saves a checkpoint and exits, as grt-train does under SLURM; no further job starts, and the grid exits 128 +
the signal's number. Jobs run in their own process group, so a Ctrl-C reaches them once, through the grid
(a second Ctrl-C stops them at once, without the checkpoint, as it does grt-train).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from grt_megatron.training.cli import RECIPES


def _fail(message: str) -> None:
    print(f"grt-grid: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grt-grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="+", help="experiment recipes, e.g. cpu/grt_isoflops (recipes/experiment/)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0], help="token budgets (× the 1× budget)")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP threads per job (default: the free cores shared among --workers, read at each "
                             "job's start)")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/experiments/logs"),
                        help="one log per job, and grid.jsonl with each job's wall time and exit status")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.overrides = overrides
    missing = [c for c in args.cells if not (RECIPES / "experiment" / f"{c}.yaml").is_file()]
    if missing:
        _fail(f"no experiment recipe {', '.join(missing)} in {RECIPES / 'experiment'}")
    if args.workers < 1:
        _fail(f"--workers must be >= 1, got {args.workers}")
    if args.threads is not None and args.threads < 1:
        _fail(f"--threads must be >= 1, got {args.threads}")
    return args


LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT"}


def job_arguments(cell: str, seed: int, budget: float, overrides: list[str]) -> list[str]:
    return [f"experiment={cell}", f"seed={seed}", f"experiment.budget={budget}", "resume=auto", *overrides]


def plan_jobs(jobs, overrides: list[str]) -> list[tuple[Path, int, Path]]:
    """(run dir, train.iters, checkpoint folder) of every job, composed as grt-train composes it; the first job
    whose configuration does not compose or validate ends the grid before any job starts."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from grt_megatron.data import DataError
    from grt_megatron.model import ConfigError
    from grt_megatron.training.cli import compose_run_config

    plans = []
    for cell, seed, budget in jobs:
        try:
            cfg = compose_run_config(job_arguments(cell, seed, budget, overrides), world_size=1)  # a world of one
        except (HydraException, OmegaConfBaseException, ConfigError, DataError) as err:
            _fail(f"{cell} seed {seed} budget {budget}: {str(err).splitlines()[0]}")
        plans.append((Path(cfg.run.dir), cfg.train.iters, cfg.checkpoint_root))
    return plans


def latest_step(metrics: Path) -> int:
    """The last step a run's metrics.jsonl records (0 before its first record), read from the file's end."""
    try:
        with metrics.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):  # a line cut by the seek, or one being written
            continue
    return 0


def run_step(run_dir: Path, checkpoints: Path) -> int:
    """How far a run got: its metrics' last step, or its newest whole checkpoint's where that is later (a run
    stopped between two logged steps saves at the step it stopped)."""
    from grt_megatron.checkpoint.store import list_checkpoints

    saved = [c.step for c in list_checkpoints(checkpoints) if c.complete]
    return max([latest_step(run_dir / "metrics.jsonl"), *saved])


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a failed job's log: usually the one-line error that says why."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


TRAINING_MODULE = "grt_megatron.training.cli"


def usable_cores() -> int:
    """The cores this process may run on (a SLURM or cgroup CPU mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Interpreter options that take the next argument as their value (`python -X importtime -W ignore -m ...`).
PYTHON_OPTIONS_WITH_VALUE = {"-X", "-W", "--check-hash-based-pycs"}


def program_of(argv: list[str]) -> str | None:
    """What a process runs: the module of `python [options] -m MODULE`, the name of the script of `python
    [options] SCRIPT` (a console script such as grt-train runs so), the executable's own name where it is
    not a Python interpreter, None for `python -c` or a bare interpreter."""
    if not argv or not argv[0]:
        return None
    name = Path(argv[0]).name
    if not (name.startswith("python") or name.startswith("pypy")):
        return name
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "-m":
            return next(rest, None)
        if arg.startswith("-m"):  # -mMODULE
            return arg[2:]
        if arg.startswith("-c"):
            return None
        if arg in PYTHON_OPTIONS_WITH_VALUE:
            next(rest, None)
        elif not arg.startswith("-") or arg == "-":
            return Path(arg).name
    return None


def is_training(argv: list[bytes]) -> bool:
    """Whether a process's command line is a training: `python [options] -m grt_megatron.training.cli`
    (grt-grid's jobs, torchrun's ranks) or the `grt-train` script. A launcher (torchrun, grt-grid, srun)
    that names it among its arguments is not: its program is the launcher."""
    return program_of([a.decode(errors="replace") for a in argv]) in (TRAINING_MODULE, "grt-train")


def training_processes(proc: Path = Path("/proc"), exclude: set[int] | None = None) -> list[tuple[int, int]]:
    """(pid, threads) of every grt-train process running on this machine: its OMP_NUM_THREADS, or all usable
    cores where that is unset or unreadable (torch's default). Empty where there is no /proc."""
    exclude = {os.getpid()} if exclude is None else exclude
    default_threads, found = usable_cores(), []
    for entry in proc.glob("[0-9]*"):
        try:
            pid = int(entry.name)
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):  # gone since the listing, or not ours to read
            continue
        if pid in exclude or not is_training(args):
            continue
        threads = default_threads
        try:
            for var in (entry / "environ").read_bytes().split(b"\0"):
                if var.startswith(b"OMP_NUM_THREADS="):
                    threads = int(var.split(b"=", 1)[1]) or threads
        except (OSError, ValueError):
            pass
        found.append((pid, threads))
    return sorted(found)


def threads_per_job(cores: int, busy_threads: int, workers: int) -> int:
    """Each job's OMP_NUM_THREADS: the cores other trainings leave free, shared by this grid's workers; at
    least one (then the machine is oversubscribed, and the caller says so)."""
    return max(1, (cores - busy_threads) // workers)


def job_threads(cores: int, workers: int, own: set[int], proc: Path = Path("/proc")) -> int:
    """The threads a job starting now gets: the cores that trainings other than this grid's own jobs leave
    free, shared among its workers. Read at each job's start, not once at the grid's: a grid started beside
    this one, or one that ended, changes what is free for the jobs still waiting."""
    elsewhere = training_processes(proc, exclude=own)
    return threads_per_job(cores, sum(t for _, t in elsewhere), workers)


def job_outcome(returncode: int, step: int, iters: int) -> str:
    """"finished", "stopped" (a signal or train.exit_interval ended it before train.iters; the same command
    resumes it) or "failed". grt-train exits 0 after a requeue request, so the exit status alone cannot tell
    a stopped run from a finished one: the step it reached (`run_step`) does."""
    if returncode == 0:
        return "finished" if step >= iters else "stopped"
    return "stopped" if returncode == 128 + signal.SIGINT or returncode == 128 + signal.SIGTERM else "failed"


class JobSignals:
    """Passes the grid's SIGINT / SIGTERM / SIGHUP on to the grt-train processes it runs, keeps new ones from
    starting: a stopped grid leaves every run at a checkpoint, not orphaned or killed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.signum = None

    @contextmanager
    def installed(self):
        """The forwarding handlers while the grid runs; the caller's own ones after (a grid run in-process).
        A signal the grid was started with ignored stays ignored (`nohup grt-grid`, a background job's SIGINT)."""
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for signum, handler in previous.items():
            if handler is not signal.SIG_IGN:
                signal.signal(signum, self.forward)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def forward(self, signum, frame) -> None:
        with self.lock:
            self.signum = self.signum or signum
            for proc in self.running:  # grt-train does not handle SIGHUP; SIGTERM is its "save and stop"
                proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def start(self, cmd, **kwargs):
        """The job's process, or None once the grid was told to stop."""
        with self.lock:
            if self.signum is not None:
                return None
            proc = subprocess.Popen(cmd, process_group=0, **kwargs)  # the terminal's Ctrl-C comes via forward
            self.running.add(proc)
            return proc

    def pids(self) -> set[int]:
        with self.lock:
            return {proc.pid for proc in self.running}

    def wait(self, proc: subprocess.Popen) -> int:
        rc = proc.wait()
        with self.lock:
            self.running.discard(proc)
        return rc


def run_job(cell: str, seed: int, budget: float, overrides: list[str], threads_for: Callable[[], int],
            log_dir: Path, plan: tuple[Path, int, Path], signals: JobSignals) -> dict:
    log = log_dir / f"{cell.replace('/', '__')}-budget{budget}-seed{seed}.log"
    args = job_arguments(cell, seed, budget, overrides)
    # This interpreter's grt-train, whether or not the environment's bin folder is on PATH.
    cmd = [sys.executable, "-m", "grt_megatron.training.cli", *args]
    # Each job is a world of one on its own free port: a launcher's RANK / MASTER_PORT inherited from
    # the caller (a grid started inside torchrun, or a process that already joined a process group)
    # would make every job bind the same, taken port.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    threads = threads_for()  # sized when the job starts, not when the grid did: other grids come and go
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = time.perf_counter()
    run_dir, iters, checkpoints = plan
    with log.open("a") as out:
        out.write(f"$ grt-train {' '.join(args)}\n")
        out.flush()
        proc = signals.start(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        if proc is None:  # the grid was stopped while this job waited for a worker
            out.write(f"not started: grt-grid was stopped by {signal.Signals(signals.signum).name}\n")
            rc, step, outcome = None, None, "not started"
        else:
            rc = signals.wait(proc)
            step = run_step(run_dir, checkpoints)
            outcome = job_outcome(rc, step, iters)
    return {"cell": cell, "seed": seed, "budget": budget, "returncode": rc, "outcome": outcome, "step": step,
            "iters": iters, "threads": threads, "seconds": round(time.perf_counter() - start, 1), "log": str(log),
            "command": "grt-train " + " ".join(args), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main(argv=None) -> None:
    from grt_megatron.console import quiet_known_warnings

    args = parse_args(argv)
    quiet_known_warnings()  # composing the jobs' configs imports megatron-core, which warns about optional kernels
    # Installed before planning: a signal while the configs compose starts no job and ends with the summary.
    with JobSignals().installed() as signals:
        run_grid(args, signals)


def run_grid(args: argparse.Namespace, signals: JobSignals) -> None:
    jobs = [(c, s, b) for b in args.budgets for c in args.cells for s in args.seeds]
    plans = plan_jobs(jobs, args.overrides)
    try:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _fail(f"--log-dir {args.log_dir}: cannot create it ({err.strerror or err})")
    cores, others = usable_cores(), training_processes()
    busy = sum(t for _, t in others)
    threads = args.threads or threads_per_job(cores, busy, args.workers)

    def threads_for_job() -> int:
        return args.threads or job_threads(cores, args.workers, own={os.getpid(), *signals.pids()})
    load = busy + threads * min(args.workers, len(jobs))
    if others:
        pids = ", ".join(str(pid) for pid, _ in others[:4]) + (" …" if len(others) > 4 else "")
        print(f"grt-grid: warning: {len(others)} grt-train process(es) already running here (pid {pids}) use "
              f"{busy} of {cores} cores; this grid's jobs get {threads} thread(s) each"
              + (f", {load} threads on {cores} cores: every run will be slower (run cells in one grid with "
                 f"--workers instead)" if load > cores else ""), file=sys.stderr)
    elif load > cores:
        print(f"grt-grid: warning: --threads {threads} × {min(args.workers, len(jobs))} job(s) at a time is "
              f"{load} threads on {cores} cores: every run will be slower", file=sys.stderr)

    def steps_done() -> int:  # resumed jobs count the steps they had
        return sum(min(latest_step(run_dir / "metrics.jsonl"), iters) for run_dir, iters, _ in plans)

    start, outcomes, returned = time.perf_counter(), [], 0
    interactive = sys.stderr.isatty()
    with ThreadPoolExecutor(args.workers) as pool, (args.log_dir / "grid.jsonl").open("a") as record, \
            tqdm(total=sum(iters for _, iters, _ in plans), initial=steps_done(), desc="grid", unit="step",
                 dynamic_ncols=True, mininterval=1 if interactive else 60) as bar:
        pending = {pool.submit(run_job, c, s, b, args.overrides, threads_for_job, args.log_dir, plan, signals)
                   for (c, s, b), plan in zip(jobs, plans)}
        bar.set_postfix_str(f"0/{len(jobs)} runs")
        while pending:
            done, pending = wait(pending, timeout=5, return_when=FIRST_COMPLETED)
            for future in done:
                result = future.result()
                returned += 1
                outcomes.append(result["outcome"])
                if result["outcome"] == "not started":
                    continue
                record.write(json.dumps(result) + "\n")
                record.flush()
                rc, outcome = result["returncode"], result["outcome"]
                status = {"finished": "ok",
                          "stopped": f"stopped at step {result['step']} of {result['iters']}"
                                     + (f" (exit {rc})" if rc else "") + "; the same command resumes it",
                          "failed": f"FAILED (exit {rc})"}[outcome]
                tqdm.write(f"{result['cell']} seed {result['seed']} budget {result['budget']}: {status} in "
                           f"{result['seconds']:.0f} s ({result['log']})")
                if outcome == "failed":
                    tqdm.write(log_tail(Path(result["log"])))
                bar.set_postfix_str(f"{returned}/{len(jobs)} runs", refresh=False)
            bar.update(steps_done() - bar.n)
    stopped, failed, waiting = (outcomes.count(o) for o in ("stopped", "failed", "not started"))
    others = (f", {stopped} stopped before train.iters" if stopped else "") + \
        (f", {waiting} not started" if waiting else "") + (f", {failed} failed" if failed else "") + \
        (" (the same command resumes them)" if stopped or waiting else "")
    by = f" (stopped by {signal.Signals(signals.signum).name})" if signals.signum else ""
    print(f"grid: {outcomes.count('finished')}/{len(jobs)} runs finished{others} in "
          f"{time.perf_counter() - start:.0f} s{by}")
    if signals.signum:
        sys.exit(128 + signals.signum)
    if stopped or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
