"""`grt-submit`: render `slurm/train.sbatch.in` for a run and submit it with sbatch (or print it).

    grt-submit --preset medium_grt_isoflops --run-dir /scratch/$USER/grt-medium --partition gpu --account abc
    grt-submit --run-dir runs/tiny --nodes 1 --procs-per-node 2 --time 00:30:00 --dry-run -- \
        model=tiny data=runs/demo/data/corpus train.iters=300 checkpoint.interval=50

Everything after `--` goes to grt-train; the run is checked as grt-train would check it at the job's world size
(nodes × processes per node) before anything is written or submitted, and a pipeline-parallel run's stages
are printed when its vocabulary is known here. Every job resumes with `resume=auto`, saves and requeues itself on
USR1 (sent `--signal-seconds` before the time limit), and `--chain N` submits N jobs that run one after the
other (`--dependency=singleton`) for runs longer than the time limit.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import yaml

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
TEMPLATE = SLURM_DIR / "train.sbatch.in"
PRESETS = SLURM_DIR / "presets.yaml"
DEFAULTS = dict(nodes=1, procs_per_node=1, gpus_per_node=0, launcher="torchrun", time="24:00:00",
                signal_seconds=300, cpus_per_task=None, cpus_per_proc=None, mem=None, partition=None, account=None,
                qos=None, chain=1, job_name=None, overrides=[], env=[])
# CPU cores per training process when none are asked for: a GPU process needs a few for its host-side
# work (batch indexing, checkpoint hashing and writing, the Python loop); a CPU process computes with one.
CPUS_PER_GPU_PROC, CPUS_PER_CPU_PROC = 8, 1


class SubmitError(ValueError):
    pass


def load_presets(path: Path = PRESETS) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def resolve(args: argparse.Namespace) -> dict:
    """Defaults, then the preset, then what was given on the command line."""
    settings = dict(DEFAULTS)
    if args.preset:
        presets = load_presets()
        if args.preset not in presets:
            raise SubmitError(f"--preset {args.preset!r} is not one of {', '.join(sorted(presets))} ({PRESETS})")
        unknown = set(presets[args.preset]) - set(DEFAULTS)
        if unknown:
            raise SubmitError(f"{PRESETS}: preset {args.preset} has unknown keys {sorted(unknown)}")
        settings.update(presets[args.preset])
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None and value != []:
            settings[key] = value
    settings["overrides"] = list(settings["overrides"]) + list(args.grt_train_args or [])
    if settings["launcher"] not in ("torchrun", "srun"):
        raise SubmitError(f"--launcher {settings['launcher']!r} is not one of torchrun, srun")
    for key in ("nodes", "procs_per_node", "chain"):
        if int(settings[key]) < 1:
            raise SubmitError(f"--{key.replace('_', '-')} must be >= 1, got {settings[key]}")
    gpus, procs = int(settings["gpus_per_node"]), int(settings["procs_per_node"])
    if gpus and gpus < procs:
        raise SubmitError(f"--procs-per-node {procs} needs as many GPUs, but --gpus-per-node is {gpus}")
    # sbatch would take these into the script and refuse the job only when submitted (or, for the signal,
    # never: USR1@-1 is no warning at all).
    if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", str(settings["time"])):
        raise SubmitError(f"--time {settings['time']!r}: write it as SLURM does, MM, HH:MM:SS or D-HH:MM:SS")
    if int(settings["signal_seconds"]) < 1:
        raise SubmitError(f"--signal-seconds must be >= 1, got {settings['signal_seconds']}")
    for key in ("cpus_per_task", "cpus_per_proc"):
        if settings[key] is not None and int(settings[key]) < 1:
            raise SubmitError(f"--{key.replace('_', '-')} must be >= 1, got {settings[key]}")
    if settings["mem"] is not None and not re.fullmatch(r"\d+[KMGT]?", str(settings["mem"]), flags=re.IGNORECASE):
        raise SubmitError(f"--mem {settings['mem']!r}: a size as sbatch takes it, e.g. 200G, 64000M or 0 (all)")
    for item in settings["env"]:
        if "=" not in item:
            raise SubmitError(f"--env {item!r} is not NAME=VALUE")
    for arg in settings["overrides"]:
        if arg.split("=", 1)[0] in ("run.dir", "resume"):
            raise SubmitError(f"{arg}: grt-submit sets run.dir (from --run-dir) and resume=auto itself")
    return settings


def world_size(settings: dict) -> int:
    return int(settings["nodes"]) * int(settings["procs_per_node"])


def validate_run(run_dir: Path, settings: dict):
    """Refuse now what grt-train would refuse at its start, at the job's world size, with the same code
    (hydra composes the job's overrides, `build_run_config` checks the layout, batch split and model).
    Returns the run's config."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from grt_megatron.model.config import ConfigError
    from grt_megatron.training.cli import compose_run_config

    world = world_size(settings)
    try:
        return compose_run_config([*settings["overrides"], f"run.dir={run_dir}", "resume=auto"], world_size=world)
    except ConfigError as err:
        raise SubmitError(f"grt-train would refuse this run on {world} processes: {err}") from None
    except (HydraException, OmegaConfBaseException) as err:
        raise SubmitError(f"grt-train overrides: {str(err).splitlines()[0]}") from None


def data_paths_not_here(cfg) -> list[str]:
    """The run's data files (prefixes, a local source, a tokenizer file) that this machine does not have,
    each as `field value: what is missing`. A job with one of them would wait in the queue and then fail
    at its start. They are warned about, not refused: a login node may not mount what the compute nodes
    read (a node-local disk, a path made by an earlier job)."""
    from grt_megatron.data import DataError
    from grt_megatron.data.indexed import prefix_paths
    from grt_megatron.data.sources import check_sources
    from grt_megatron.data.tokenizer import check_tokenizer_file

    d, missing = cfg.data, []
    for i, prefix in enumerate(d.prefixes or []):
        paths = prefix_paths(prefix)
        absent = [str(paths[key]) for key in ("idx", "bin") if not paths[key].is_file()]
        if absent:
            missing.append(f"data.prefixes[{i}] {prefix}: {' and '.join(absent)} not found")
    if d.source:
        try:
            check_sources(d.source)
        except DataError as err:
            missing.append(f"data.source: {err}")
    if d.tokenizer:
        try:
            check_tokenizer_file(d.tokenizer)  # a hub name passes
        except DataError:
            missing.append(f"data.tokenizer {d.tokenizer}: no such file")
    return missing


def pipeline_stages_line(cfg, run_dir: Path) -> Optional[str]:
    """With pipeline parallelism, the stages the job will run (the same plan grt-train prints at its start),
    when the vocabulary is known here: the head's cost is 2·d·V. None without PP."""
    if cfg.parallel.pp == 1:
        return None
    from grt_megatron.data import DataError
    from grt_megatron.data.prepare import tokenizer_of_prefix
    from grt_megatron.data.tokenizer import load_tokenizer
    from grt_megatron.model.config import ConfigError
    from grt_megatron.parallel.pipeline_stages import plan_pipeline_stages

    d, tokenizer, where = cfg.data, None, None
    try:
        if d.tokenizer and Path(d.tokenizer).expanduser().exists():
            tokenizer, where = load_tokenizer(d.tokenizer), f"data.tokenizer {d.tokenizer}"
        elif not d.tokenizer:
            prefix = str(run_dir / "data" / "corpus") if d.source else (d.prefixes or [None])[0]
            tokenizer = tokenizer_of_prefix(prefix) if prefix else None
            where = f"{prefix}.tokenizer.model"
    except DataError:
        tokenizer = None  # the job reports it at its start (and the warnings above name missing files)
    known = tokenizer.vocab_size if tokenizer else cfg.model.get("vocab_size")
    if known is None:
        return ("pipeline stages: decided at the job's start, when its tokenizer is known (the head's cost is "
                "2·d·V)")
    try:  # grt-train's call: model.vocab_size wins, and one below the tokenizer's is refused
        model = cfg.model_config(known)
        stages = plan_pipeline_stages(model, cfg.seq_length, cfg.parallel.pp, cfg.parallel.pp_split_points)
    except ConfigError as err:
        raise SubmitError(f"grt-train would refuse this run: {err}") from None
    source = "model.vocab_size" if cfg.model.get("vocab_size") else where
    return f"pipeline stages (vocabulary {model.vocab_size}, from {source}): {stages.describe()}"


def cpus(settings: dict) -> tuple[int, int]:
    """(--cpus-per-task, OMP_NUM_THREADS): cores per training process times the processes of a task
    (torchrun: one task per node runs them all; srun: one task per process)."""
    procs = int(settings["procs_per_node"])
    per_proc = settings["cpus_per_proc"] or (CPUS_PER_GPU_PROC if int(settings["gpus_per_node"]) else CPUS_PER_CPU_PROC)
    torchrun = settings["launcher"] == "torchrun"
    per_task = int(settings["cpus_per_task"] or (procs * per_proc if torchrun else per_proc))
    return per_task, max(1, per_task // procs if torchrun else per_task)


def render(run_dir: Path, settings: dict, python: str = sys.executable) -> str:
    procs = int(settings["procs_per_node"])
    torchrun = settings["launcher"] == "torchrun"
    cpus_per_task, threads = cpus(settings)
    extra = [f"#SBATCH --{flag}={settings[key]}" for flag, key in
             (("partition", "partition"), ("account", "account"), ("qos", "qos"), ("mem", "mem"))
             if settings[key] is not None]
    if int(settings["gpus_per_node"]):
        extra.append(f"#SBATCH --gpus-per-node={settings['gpus_per_node']}")
    if int(settings["chain"]) > 1:
        extra.append("#SBATCH --dependency=singleton")
    env = [f"export OMP_NUM_THREADS={threads}   # the cores of the task shared by its training processes",
           "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective ends the job instead of hanging it"]
    env += [f"export {shlex.quote(item.split('=', 1)[0])}={shlex.quote(item.split('=', 1)[1])}"
            for item in settings["env"]]
    fields = {
        "JOB_NAME": settings["job_name"] or f"grt-{run_dir.name}", "NODES": settings["nodes"],
        "TASKS_PER_NODE": 1 if torchrun else procs, "CPUS_PER_TASK": cpus_per_task, "TIME": settings["time"],
        "RUN_DIR": shlex.quote(str(run_dir)), "SIGNAL_SECONDS": settings["signal_seconds"],
        "SBATCH_EXTRA": "\n".join(extra), "LAUNCHER": settings["launcher"], "PROCS_PER_NODE": procs,
        "ENV": "\n".join(env), "PYTHON": shlex.quote(python),
        "OVERRIDES": " ".join(shlex.quote(o) for o in settings["overrides"]),
    }
    text = TEMPLATE.read_text()
    for key, value in fields.items():
        text = text.replace(f"@@{key}@@", str(value))
    return text


def submit(script: Path, chain: int) -> list[str]:
    ids = []
    for _ in range(chain):
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if proc.returncode:
            raise SubmitError(f"sbatch {script}: {proc.stderr.strip() or proc.stdout.strip()}")
        ids.append(proc.stdout.strip().split(";")[0])
    return ids


def main(argv: list[str] | None = None) -> int:
    from grt_megatron.console import quiet_known_warnings

    quiet_known_warnings()  # the run check imports megatron-core, which warns about optional kernels
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="grt-submit", description=__doc__.split("\n\n")[0],
                                     epilog="grt-train overrides follow `--`.")
    parser.add_argument("--run-dir", required=True, help="the run directory (shared by every node)")
    parser.add_argument("--preset", help=f"a named set of the options below ({PRESETS.name})")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--procs-per-node", type=int, help="training processes per node (GPUs per node)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs to request per node (0: no GPU request)")
    parser.add_argument("--launcher", choices=("torchrun", "srun"))
    parser.add_argument("--time", help="time limit, HH:MM:SS or D-HH:MM:SS")
    parser.add_argument("--signal-seconds", type=int, help="USR1 this long before the time limit (save + requeue)")
    parser.add_argument("--cpus-per-task", type=int, help="cores per SLURM task (default: processes × --cpus-per-proc)")
    parser.add_argument("--cpus-per-proc", type=int,
                        help=f"cores per training process (default {CPUS_PER_GPU_PROC} with GPUs, else {CPUS_PER_CPU_PROC})")
    parser.add_argument("--mem", help="memory per node, as sbatch --mem (0: all of the node's)")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--chain", type=int, help="submit N jobs that run one after another (singleton)")
    parser.add_argument("--job-name")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE exported in the job (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the run as grt-train would at the job's size and print the sbatch script; "
                             "submit nothing")
    args = parser.parse_args(argv)
    args.grt_train_args = train_args
    try:
        settings = resolve(args)
        run_dir = Path(args.run_dir).resolve()
        cfg = validate_run(run_dir, settings)
        for problem in data_paths_not_here(cfg):
            print(f"grt-submit: warning: {problem} on this machine; the job will fail at its start unless the "
                  "compute nodes have it", file=sys.stderr)
        stages = pipeline_stages_line(cfg, run_dir)
        if stages:
            print(f"grt-submit: {stages}", file=sys.stderr)
        script = render(run_dir, settings)
        if args.dry_run:
            print(script)
            return 0
        path = run_dir / "slurm" / "job.sbatch"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
        except OSError as err:
            raise SubmitError(f"--run-dir {args.run_dir}: cannot write {path} ({err.strerror or err})") from None
        ids = submit(path, int(settings["chain"]))
    except SubmitError as err:
        print(f"grt-submit: error: {err}", file=sys.stderr)
        return 2
    print(f"submitted {','.join(ids)} ({path}); log: {run_dir / 'slurm.log'}; "
          f"watch: squeue -j {','.join(ids)}; checkpoints: grt-ckpt ls {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
