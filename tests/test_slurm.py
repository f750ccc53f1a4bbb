"""grt-submit's jobs on a real SLURM cluster on loopback (tests/slurm_cluster.py): torchrun under srun,
USR1 → save → requeue → resume on the same loss curve, a singleton chain, two emulated nodes. Every job's
curve is the plain-torchrun reference's, step for step."""

import subprocess
import sys
import time

import pytest
from conftest import REPO, read_jsonl, run_cli
from slurm_cluster import SlurmCluster, missing_binaries

pytestmark = pytest.mark.skipif(bool(missing_binaries()), reason=f"SLURM not installed ({', '.join(missing_binaries())}"
                                "; `make test` installs it as root)")
def _train_args(prefix, iters, extra=(), wandb="disabled"):
    return ["model=tiny", f"data={prefix}", f"train.iters={iters}", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.eval_iters=1", f"train.eval_interval={iters}",
            "model.hidden_dropout=0.1", f"logging.wandb={wandb}", "logging.progress=false", *extra]


def _curve(run_dir):
    return [(r["step"], r.get("split"), r["loss"], r.get("grad_norm")) for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(pydoc_prefix, tmp_path_factory):
    """16 steps on 2 processes (DP 2) under plain torchrun: the curve every SLURM job must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli([*_train_args(pydoc_prefix[0], 16, ["data.train_samples=256"]), f"run.dir={run_dir}"],
                   launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29951"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _curve(run_dir)


def _submit(cluster, run_dir, options, train_args):
    proc = subprocess.run([sys.executable, "-m", "grt_megatron.launch.submit", "--run-dir", str(run_dir), *options,
                           "--", *train_args], cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("submitted ")[1].split(" ")[0].split(",")


def test_dry_run_prints_the_script_it_would_submit(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grt_megatron.launch.submit", "--preset", "large_grt_isoflops",
                           "--run-dir", str(tmp_path / "run"), "--partition", "gpu", "--dry-run", "--",
                           "data=/scratch/corpus"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --dependency=singleton", "model=large_grt_isoflops", "data=/scratch/corpus", "resume=auto"):
        assert line in script, line
    assert not (tmp_path / "run").exists()  # nothing written, nothing submitted
    bad = subprocess.run([sys.executable, "-m", "grt_megatron.launch.submit", "--run-dir", "x", "--dry-run", "--",
                          "resume=/elsewhere"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "grt-submit sets run.dir" in bad.stderr


def test_usr1_saves_requeues_and_resumes_on_the_same_curve(cluster, pydoc_prefix, tmp_path, reference):
    run_dir = tmp_path / "run"
    [job] = _submit(cluster, run_dir, ["--procs-per-node", "2", "--time", "00:10:00"],
                    _train_args(pydoc_prefix[0], 16, ["data.train_samples=256"], wandb="offline"))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline, (run_dir / "slurm.log").read_text()[-3000:]
        time.sleep(0.05)
    # What --signal=B:USR1@N delivers before the time limit.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env, check=True)
    info = cluster.wait(job, restarts=1)
    log = (run_dir / "slurm.log").read_text()
    # torchrun under srun, two ranks on the node (each job here is a submitted script's whole path).
    assert f"job {job} (restart 0)" in log and "torchrun, 1 node(s) x 2" in log, log[-3000:]
    assert "USR1, saving a checkpoint and requeueing" in log and f"job {job} (restart 1)" in log, log[-3000:]
    assert "stopped by SIGTERM at step" in log and "resumed from" in log
    assert int(info["Restarts"]) == 1 and "SLURM job " + job + ", restart 1" in log
    assert _curve(run_dir) == reference  # every step once, identical to the uninterrupted run
    # One wandb run across the restart: both starts logged to the run id kept in the run directory.
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    starts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(p.name.endswith(run_id) for p in starts), starts


def test_singleton_chain_continues_from_the_first_jobs_checkpoint(cluster, pydoc_prefix, tmp_path, reference):
    run_dir = tmp_path / "run"
    jobs = _submit(cluster, run_dir, ["--procs-per-node", "2", "--chain", "2", "--time", "00:10:00"],
                   _train_args(pydoc_prefix[0], 16, ["data.train_samples=256", "train.exit_interval=8"]))
    assert len(jobs) == 2
    assert "Dependency=singleton" in cluster.scontrol("show", "job", jobs[1])
    for job in jobs:
        cluster.wait(job)
    log = (run_dir / "slurm.log").read_text()
    assert "stopped by train.exit_interval at step 8" in log
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'} at step 8" in log
    assert _curve(run_dir) == reference


def test_two_node_job_trains(pydoc_prefix, tmp_path, reference):
    cluster = SlurmCluster(tmp_path / "cluster", nodes=2).start()
    try:
        run_dir = tmp_path / "run"
        [job] = _submit(cluster, run_dir, ["--nodes", "2", "--procs-per-node", "1", "--launcher", "srun",
                                           "--time", "00:10:00"],
                        _train_args(pydoc_prefix[0], 4, ["data.train_samples=256"]))
        info = cluster.wait(job)
        assert info["NodeList"] == "node[1-2]"
        assert "srun, 2 node(s) x 1" in (run_dir / "slurm.log").read_text()
        # One rank per emulated node: DP 2, the same losses as two local processes.
        assert [c for c in _curve(run_dir) if c[1] is None] == [c for c in reference if c[1] is None][:4]
    finally:
        cluster.stop()
