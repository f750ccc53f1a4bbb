"""Resuming is exact: N steps straight == N/2 steps + resume + N/2 steps, bit for bit, in every layout;
killed saves, SIGUSR1, resharding and refused changes (grt-train and grt-ckpt as users run them)."""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors import safe_open

from conftest import BF16_SHORT, REPO, cli_env, read_jsonl, run_cli, start_cli, wait_for

QUIET = ["logging.wandb=disabled", "logging.progress=false"]
PORT = iter(range(29710, 29800))


def _torchrun(procs):
    if procs == 1:
        return None
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={next(PORT)}"]


def _args(prefix, iters=4, dropout=0.1, interval=2, extra=()):
    # Dropout on: a resumed run repeats its masks only if every rank's RNG states come back.
    model = next((a for a in extra if a.startswith("model=")), "model=tiny")  # a layout may pick another model
    extra = [a for a in extra if a != model]
    return [model, f"data={prefix}", f"train.iters={iters}", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.eval_iters=1", f"train.eval_interval={iters}",
            f"checkpoint.interval={interval}", f"model.hidden_dropout={dropout}", f"model.attention_dropout={dropout}",
            *QUIET, *extra]


def _curve(run_dir, after=0):
    return [(r["step"], r.get("split"), r["loss"], r.get("grad_norm")) for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["step"] > after]


def _assert_curves_close(want, got):
    """Same steps and splits; losses and grad norms within reduction-order rounding."""
    assert [w[:2] for w in want] == [g[:2] for g in got]
    for w, g in zip(want, got):
        assert g[2] == pytest.approx(w[2], rel=1e-5)
        if w[3] is not None:
            assert g[3] == pytest.approx(w[3], rel=1e-5)


# One process in fp32 resumes to the uninterrupted curve in test_sigkill_... (ten times, sync and background
# saves) and test_sigusr1_...; in DeepSpeed's bf16 in tools/gpu_check.py's kill_resume_bf16 (its CPU mode runs in
# tests/test_gpu_check.py). Each layout below adds what those do not.
LAYOUTS = [
    ("tp2", 2, ["parallel.tp=2"]),
    ("pp2", 2, ["parallel.pp=2", "deepspeed.zero_stage=1"]),
    # a background writer saves what a synchronous save would (ZeRO 3's synchronous save is resumed, in
    # one process, by test_reshard_to_one_process[dp2-zero3])
    ("dp2-zero3-async", 2, ["deepspeed.zero_stage=3", "checkpoint.async_save=true"]),
    # DP 2's partitioned optimizer state (ZeRO 2 keeps it as ZeRO 1 does: DeepSpeed's one stage-1-and-2
    # optimizer), and the depth-reuse baselines' own modules (exit head, per-recursion LoRA) come back too
    ("ouro-dp2-zero1", 2, ["model=tiny_ouro", "deepspeed.zero_stage=1"]),
    ("rrt-1p", 1, ["model=tiny_rrt"]),
    # torch's fused AdamW under DeepSpeed's BF16 optimizer (its step count lives with the parameters)
    ("1p-bf16-fused-adam", 1, ["train.precision=bf16", "train.fused_adam=true", *BF16_SHORT]),
    # fp32 weights under autocast, the bare fused AdamW stepping them, clipped by the trainer
    ("1p-bf16-mixed-fused-adam", 1, ["train.precision=bf16-mixed", "train.fused_adam=true", *BF16_SHORT]),
]


@pytest.mark.parametrize("name,procs,layout", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_resume_is_bit_exact(pydoc_prefix, tmp_path, name, procs, layout):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_cli([*_args(pydoc_prefix[0], extra=layout), f"run.dir={straight}"], launcher=_torchrun(procs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    half = straight / "checkpoints" / "step_00000002"
    proc = run_cli([*_args(pydoc_prefix[0], extra=layout), f"run.dir={resumed}", f"resume={half}"],
                   launcher=_torchrun(procs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {half} at step 2" in proc.stdout
    want, got = _curve(straight, after=2), _curve(resumed)
    assert len(want) == 3 and got == want  # steps 3, 4 and the eval: losses and grad norms identical


def test_resume_with_the_pipeline_cut_elsewhere_reseeds_and_continues(pydoc_prefix, tmp_path):
    """Parameters are saved by name, not by stage, so a run resumes with its stages cut elsewhere (split
    points, or a checkpoint from before stages were balanced by FLOPs); its layers then sit on other ranks,
    whose saved RNG streams are not theirs, so it reseeds as a resharded resume does and says so. Without
    dropout the curve continues within rounding."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    layout = ["parallel.pp=2", "deepspeed.zero_stage=1"]
    proc = run_cli([*_args(pydoc_prefix[0], dropout=0.0, extra=layout), f"run.dir={straight}"], launcher=_torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline stages: embedding layer.0 core (" in proc.stdout  # balanced: layer.2 starts stage 2
    half = straight / "checkpoints" / "step_00000002"
    proc = run_cli([*_args(pydoc_prefix[0], dropout=0.0, extra=[*layout, "parallel.pp_split_points=[core]"]),
                    f"run.dir={resumed}", f"resume={half}"], launcher=_torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"resumed from {half} at step 2 (2048 tokens); saved with pipeline stages split at ['layer.2'], now "
            "at ['core'], RNG states reseeded") in proc.stdout, proc.stdout[-2000:]
    want, got = _curve(straight, after=2), _curve(resumed)
    assert len(want) == 3
    _assert_curves_close(want, got)


RESHARD = {"dp2-zero0": ["deepspeed.zero_stage=0"], "dp2-zero1": ["deepspeed.zero_stage=1"],
           "dp2-zero3": ["deepspeed.zero_stage=3"], "tp2": ["parallel.tp=2"]}


@pytest.mark.parametrize("layout", RESHARD.values(), ids=RESHARD.keys())
def test_reshard_to_one_process(pydoc_prefix, tmp_path, layout, world):
    """Another data-parallel or tensor-parallel size and ZeRO stage: weights and optimizer state carry
    over (no dropout, so the curves agree to reduction-order rounding, as the layouts do). Each DP rank
    wrote its own part: ZeRO partitions as pieces, replicated tensors shared out; one copy in all."""
    straight, resumed = tmp_path / "two", tmp_path / "one"
    args = _args(pydoc_prefix[0], dropout=0.0)
    proc = run_cli([*args, *layout, f"run.dir={straight}"], launcher=_torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*args, f"run.dir={resumed}", f"resume={straight / 'checkpoints' / 'step_00000002'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded, RNG states reseeded" in proc.stdout
    want, got = _curve(straight, after=2), _curve(resumed)
    _assert_curves_close(want, got)  # step 4's loss follows an update made with the saved Adam moments
    # The consolidated fp32 state dict of the 2-process checkpoint is a one-process model's state dict.
    from grt_megatron.checkpoint.consolidate import consolidate
    from grt_megatron.model import GRTConfig, GRTLanguageModel

    saved = straight / "checkpoints" / "step_00000004"
    tensors, meta = consolidate(saved, progress=False)
    model = GRTLanguageModel(GRTConfig.from_recipe(json.loads(meta["model_recipe"])))
    assert model.load_state_dict(tensors, strict=True)
    if "parallel.tp=2" not in layout:
        parts = sorted(saved.glob("model-*.safetensors"))
        assert [p.name for p in parts] == ["model-tp00-pp00-dp001.safetensors", "model-tp00-pp00.safetensors"]
        elements, pieces = [], []
        for part in parts:
            with safe_open(str(part), "pt") as f:
                elements.append(sum(_numel(f.get_slice(k).get_shape()) for k in f.keys()))
                pieces += [k for k in f.keys() if "#" in k]
        # ZeRO 3 cuts every parameter into flat pieces; replicas (ZeRO 0) are shared out whole. (ZeRO 1/2's
        # partitions may cut one parameter or none: DeepSpeed decides where they fall.)
        if layout != ["deepspeed.zero_stage=1"]:
            assert bool(pieces) == (layout == ["deepspeed.zero_stage=3"]), pieces[:3]
        # weights + two moments, once: no rank wrote what another wrote, and each wrote a fair share
        assert sum(elements) == 3 * sum(t.numel() for t in tensors.values())
        assert min(elements) > 0.3 * sum(elements)
    with safe_open(str(resumed / "checkpoints" / "step_00000004" / "model-tp00-pp00.safetensors"), "pt") as f:
        # ... and close to the weights the resumed one-process run reached.
        for name in ("block.layers.0.self_attention.linear_qkv.weight", "block.injection.weight"):
            assert (f.get_tensor(f"param/{name}") - tensors[name]).abs().max() < 1e-5


def _numel(shape):
    n = 1
    for size in shape:
        n *= size
    return n


@pytest.fixture(scope="module")
def reference(pydoc_prefix, tmp_path_factory):
    """12 steps straight, saving every step (the run the interrupted ones must reproduce)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli([*_args(pydoc_prefix[0], iters=12, interval=1, extra=["data.train_samples=160"]),
                    f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_20(pydoc_prefix, tmp_path_factory):
    """The same run for 20 steps and saving nothing, for the kill test (whose saves then must not change the
    curve either): each kill moves the run on by one checkpoint or two (a loaded machine may finish the next
    save before the kill lands), so its ten kills need room beyond 12 steps."""
    run_dir = tmp_path_factory.mktemp("reference_20") / "run"
    proc = run_cli([*_args(pydoc_prefix[0], iters=20, interval=0, extra=["data.train_samples=160"]),
                    f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _newest(root):
    """The step `latest` names (0 before the first save): written last, so polling it is cheap and safe."""
    latest = root / "latest"
    return int(latest.read_text().strip()[5:]) if latest.exists() else 0


def _saves_in_progress(root):
    """The temporary directories of saves, each as (name, mtime): a new save's differs from a killed one's."""
    return {(p.name, p.stat().st_mtime_ns) for p in root.glob(".tmp-step_*")}


def _last_step_seconds(run_dir):
    for line in reversed((run_dir / "metrics.jsonl").read_text().splitlines()):
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            if "step_seconds" in (record := json.loads(line)):
                return record["step_seconds"]
    return 0.5


def _kill_at(kind, proc, root, rng, timing):
    """Wait for a random moment of `kind` in the run of `proc`, then SIGKILL it. `start-up`: before its
    first step (imports, data, resuming); `step` and `save`: after one more checkpoint than it started
    with (each kill makes progress), anywhere in the next step, or while the next save is writing."""
    started, before = time.perf_counter(), _newest(root)
    if kind == "start-up":
        time.sleep(rng.uniform(0, 0.9 * timing["start-up"]))
    else:
        wait_for(lambda: _newest(root) > before, proc)
        timing["start-up"] = timing.get("start-up") or time.perf_counter() - started
        if kind == "save":
            wait_for(lambda: any(root.glob(".tmp-step_*")), proc)
            time.sleep(rng.uniform(0, 0.03))  # a save takes ~0.1 s here
        else:  # within a step's time: the next checkpoint is rarely reached, 12 steps leave room for 10 kills
            time.sleep(rng.uniform(0, 0.8 * _last_step_seconds(root.parent)))
    assert proc.poll() is None, "the run finished before it was killed: too few steps for the kills planned"
    proc.kill()
    return proc.communicate()[0]


def test_sigkill_at_random_moments_always_resumes_to_the_uninterrupted_curve(pydoc_prefix, tmp_path, reference_20):
    """One run killed ten times at seeded random moments, each time continued with resume=auto: every
    checkpoint left is complete, each restart resumes from the newest, and the curve is the reference's.
    Restarts alternate synchronous and background saves (checkpoint.async_save, a change applied on resume):
    a `save` kill lands in the training process's own write or while the background writer runs."""
    from grt_megatron.checkpoint import inspect_checkpoint, list_checkpoints

    rng = random.Random(0)
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    iters = 20
    args = [*_args(pydoc_prefix[0], iters=iters, interval=1,
                   extra=["data.train_samples=160", "checkpoint.keep_last=2"]), f"run.dir={run_dir}"]
    plan = ["start-up"] * 2 + ["save"] * 4 + ["step"] * 3
    rng.shuffle(plan)  # seed 0: `save` kills at restarts 2, 4, 6 (synchronous) and 5 (background writer)
    timing, in_save, resume, resumed_at, kills = {}, 0, [], 0, 0
    for restart, kind in enumerate(["step", *plan]):  # the first kill after a step: it times start-up
        if resumed_at >= iters - 2:  # a heavily loaded machine moved on faster than planned: keep a step to run
            break
        saving = ["checkpoint.async_save=true"] if restart % 2 else []
        stale = _saves_in_progress(root)  # left by the previous kill (the next save removes them)
        out = _kill_at(kind, start_cli([*args, *saving, *resume]), root, rng, timing)
        in_save += bool(_saves_in_progress(root) - stale)
        left = [inspect_checkpoint(c.path, verify_hashes=True) for c in list_checkpoints(root)]
        assert left and all(c.complete for c in left), [c.problem for c in left]
        if "resumed from" in out:  # the killed restart got as far as resuming: from the newest
            assert f"resumed from {root / f'step_{resumed_at:08d}'} at step {resumed_at} " in out
        resumed_at, resume, kills = left[-1].step, ["resume=auto"], kills + 1
    assert kills >= 8, f"only {kills} of the 10 planned kills ran before step {resumed_at}"
    proc = run_cli([*args, *resume])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / f'step_{resumed_at:08d}'} at step {resumed_at} " in proc.stdout
    assert _curve(run_dir) == _curve(reference_20)  # the whole curve, every step before and after the kills
    assert in_save >= 1  # at least one kill landed inside a save (its .tmp directory was left behind)


def test_sigusr1_saves_exits_0_and_resume_continues_the_curve(pydoc_prefix, tmp_path, reference):
    run_dir = tmp_path / "run"
    args = _args(pydoc_prefix[0], iters=12, interval=0, extra=["data.train_samples=160"])
    proc = start_cli([*args, f"run.dir={run_dir}"])
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = int(out.split("stopped by SIGUSR1 at step ")[1].split(":")[0])
    assert 2 <= stopped < 12
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}").is_dir()
    proc = run_cli([*args, f"run.dir={run_dir}", "resume=auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _curve(run_dir) == _curve(reference)


def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step(pydoc_prefix, tmp_path):
    run_dir = tmp_path / "run"
    args = _args(pydoc_prefix[0], iters=40, interval=0, extra=["deepspeed.zero_stage=1"])
    proc = subprocess.Popen([*_torchrun(2), str(REPO / "grt_megatron" / "training" / "cli.py"), *args,
                             f"run.dir={run_dir}"], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[-1]), signal.SIGUSR1)  # one rank only (the last started: not rank 0's logger)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGUSR1" in out
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and len(list(checkpoints[0].glob("rng/rank*.safetensors"))) == 2


def test_changes_are_refused_or_applied_as_listed(pydoc_prefix, tmp_path, reference):
    base = _args(pydoc_prefix[0], iters=12, interval=1, extra=["data.train_samples=160"])
    checkpoint = reference / "checkpoints" / "step_00000012"
    proc = run_cli([*base, "model.hidden_size=256", "seed=7", f"run.dir={tmp_path / 'a'}", f"resume={checkpoint}"])
    assert proc.returncode == 2
    assert "model.hidden_size: 128 -> 256 (the model's shape and math)" in proc.stderr
    assert "seed: 1234 -> 7" in proc.stderr
    proc = run_cli([*base, "train.iters=30", f"run.dir={tmp_path / 'b'}", f"resume={checkpoint}"])
    assert proc.returncode == 2 and "needs 240 training samples" in proc.stderr and "data.train_samples" in proc.stderr
    # More steps within the data stream, and another LR: applied, listed, and training continues.
    proc = run_cli([*base, "train.iters=14", "train.lr=1e-3", f"run.dir={tmp_path / 'c'}", f"resume={checkpoint}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.iters: 12 -> 14" in proc.stdout and "train.lr: 0.002 -> 0.001" in proc.stdout
    assert [r[0] for r in _curve(tmp_path / "c") if r[1] is None] == [13, 14]
    # A run dir holding a run is not silently overwritten.
    proc = run_cli([*base, f"run.dir={reference}"])
    assert proc.returncode == 2 and "pass resume=auto to continue it" in proc.stderr


def test_two_ranks_verify_a_checkpoint_and_skip_a_corrupt_part(pydoc_prefix, tmp_path):
    """Resuming with 2 processes, the ranks hash the newest checkpoint's files between them; one bad byte
    in DP rank 1's part is found, that checkpoint skipped with the reason, and the run resumes from the one
    before it onto the uninterrupted curve."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = _args(pydoc_prefix[0], extra=["deepspeed.zero_stage=1"])
    proc = run_cli([*args, f"run.dir={straight}"], launcher=_torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(straight / "checkpoints", resumed / "checkpoints")
    part = resumed / "checkpoints" / "step_00000004" / "model-tp00-pp00-dp001.safetensors"
    data = bytearray(part.read_bytes())
    data[-5] ^= 0x01  # the last tensor's bytes: the size is right, the hash is not
    part.write_bytes(bytes(data))
    proc = run_cli([*args, f"run.dir={resumed}", "resume=auto"], launcher=_torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping" in proc.stdout and "model-tp00-pp00-dp001.safetensors does not match its sha256" in proc.stdout
    assert "at step 2" in proc.stdout
    assert _curve(resumed, after=2) == _curve(straight, after=2)


def test_format_1_checkpoints_still_resume(pydoc_prefix, tmp_path, reference):
    """A checkpoint written before parts per DP rank (format 1: one file per (TP, stage), no `shapes` or
    `dp_rank` metadata) resumes bit-exactly."""
    import hashlib

    from safetensors.torch import load_file, save_file

    old = tmp_path / "checkpoints" / "step_00000010"
    shutil.copytree(reference / "checkpoints" / "step_00000010", old)
    shard = old / "model-tp00-pp00.safetensors"
    with safe_open(str(shard), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k in ("tp_rank", "pp_rank", "partition_dims")}
    save_file(load_file(str(shard)), str(shard), metadata=meta)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    manifest["files"][shard.name] = {"bytes": shard.stat().st_size,
                                     "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    (old / "manifest.json").write_text(json.dumps(manifest))
    run_dir = tmp_path / "run"
    args = _args(pydoc_prefix[0], iters=12, interval=0, extra=["data.train_samples=160"])
    proc = run_cli([*args, f"run.dir={run_dir}", f"resume={old}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _curve(run_dir) == _curve(reference, after=10)


def test_grt_ckpt_lists_shows_and_consolidates(reference, tmp_path):
    from safetensors.torch import load_file

    def ckpt(*args):
        return subprocess.run([sys.executable, "-m", "grt_megatron.checkpoint.cli", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    proc = ckpt("ls", str(reference))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["checkpoint", "step", "tokens", "layout", "size", "status"]
    assert [line.split()[0] for line in lines[1:]] == ["step_00000010", "step_00000011", "step_00000012"]
    assert "tp1 pp1 dp1 zero0 fp32" in lines[-1] and lines[-1].endswith("complete, latest")
    proc = ckpt("show", str(reference / "checkpoints" / "step_00000012"))
    assert proc.returncode == 0 and '"optimizer_steps": 12' in proc.stdout
    out = tmp_path / "model.safetensors"
    proc = ckpt("consolidate", str(reference / "checkpoints" / "step_00000012"), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(str(out))
    with safe_open(str(reference / "checkpoints" / "step_00000012" / "model-tp00-pp00.safetensors"), "pt") as f:
        assert tensors["block.gate_fc1.weight"].equal(f.get_tensor("param/block.gate_fc1.weight"))
    assert ckpt("consolidate", str(reference / "checkpoints" / "step_00000012"), "--output", str(out)).returncode == 2
    proc = ckpt("consolidate", str(reference / "checkpoints" / "step_00000012"), "--output", str(out / "x"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("grt-ckpt: error: cannot write")
    assert "Traceback" not in proc.stderr  # an output under a file was one
    proc = ckpt("show", str(reference))
    assert proc.returncode == 2 and "not a grt-megatron checkpoint" in proc.stderr
