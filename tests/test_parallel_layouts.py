"""Every parallel layout gives one process's per-step losses and grad norms (fp32, GRT with uniform depth
sampling and noise on; dense too). Each layout is one torchrun launch of `grt-train` on gloo."""

import re
import sys

import pytest

from conftest import read_jsonl, run_cli, train_config

QUIET = ["logging.wandb=disabled", "logging.progress=false"]
STEPS = 3


def _common(model, prefix):
    return [f"model={model}", f"data={prefix}", f"train.iters={STEPS}", f"train.eval_interval={STEPS}",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_iters=1", *QUIET]


@pytest.fixture(scope="module")
def references(pydoc_prefix, tmp_path_factory):
    out = {}
    for name, (model, *extra) in REFERENCES.items():
        run_dir = tmp_path_factory.mktemp("ref") / name
        proc = run_cli([*_common(model, pydoc_prefix[0]), *extra, f"run.dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = read_jsonl(run_dir / "metrics.jsonl")
    # The packed rows hold several documents: the document mask changes the losses by more than the layouts'
    # tolerance below (else those layouts would not test it; at init the change is small, ~4e-5).
    change = max(abs(d["loss"] / p["loss"] - 1) for d, p in zip(out["tiny+documents"], out["tiny"]))
    assert change > 2e-5, change
    return out


DOCUMENTS = "data.reset_attention_mask=true"
REFERENCES = {name: [name] for name in ("tiny", "tiny_dense", "tiny_ouro", "tiny_rrt")}
REFERENCES["tiny+documents"] = ["tiny", DOCUMENTS]
REFERENCES["tiny+bf16-mixed"] = ["tiny", "train.precision=bf16-mixed"]
REFERENCES["tiny+fp32-residual"] = ["tiny", "train.precision=bf16-mixed", "model.fp32_residual_connection=true"]
# bf16 matmuls round where each layout's partial products meet (a TP all-reduce sums bf16 halves): the
# same math within bf16's rounding, measured at ≤ 7e-5 (grad norm) and ≤ 1.1e-5 (loss) on these runs.
TOLERANCE = {"tiny+bf16-mixed": 3e-4, "tiny+fp32-residual": 3e-4}
# ZeRO 3's weights exist only inside their own module's forward, so there each recurrence step multiplies
# the concatenations [h, h_pre] whole, where every other layout multiplies the h_pre halves once per forward
# (GatedRecurrentBlock.prelude_terms): in bf16 the two round the gate's and the injection's products in
# different places. Measured 6.1e-4 on the grad norm, 1.4e-5 on the loss.
TOLERANCE_ZERO3 = {"tiny+bf16-mixed": 1e-3}


PORT = iter(range(29610, 29700))

# Each launch costs ~10 s of start-up (torch, megatron-core and DeepSpeed imported per rank) on CI's two cores,
# so a layout is here for what no other one covers, and most cover several things at once:
#   TP 2: alone (also bf16-mixed), with SP (documents; bf16-mixed), × DP 2 with ZeRO 2 and SP, × PP 2;
#   PP 2: × DP 2, × TP 2, × TP 2 with SP (documents; an fp32 residual stream under bf16-mixed), the dense
#   model's stage split; PP 3 (bf16-mixed: a pipeline under autocast, split points putting the embedding
#   alone on a stage);
#   ZeRO over DP 2: 1 (× PP 2), 2 (recompute; × TP 2; Ouro), 3 (recompute; RRT; bf16-mixed).
# (One-process ZeRO stages, and DP 2 without ZeRO: test_train_cli.)
LAYOUTS = [
    ("tiny", 2, ["parallel.tp=2"]),
    ("tiny", 4, ["parallel.tp=2", "parallel.sp=true", "deepspeed.zero_stage=2"]),
    ("tiny", 4, ["parallel.pp=2", "deepspeed.zero_stage=1"]),
    ("tiny", 4, ["parallel.pp=2", "parallel.tp=2", "deepspeed.zero_stage=1"]),
    ("tiny_dense", 2, ["parallel.pp=2", "deepspeed.zero_stage=1"]),
    # Recurrence checkpointing (recompute in backward) changes no number, where ZeRO hooks the gradients (2)
    # and gathers the weights it recomputes with (3).
    ("tiny", 2, ["deepspeed.zero_stage=2", "model.checkpoint_recurrence=true"]),
    ("tiny", 2, ["deepspeed.zero_stage=3", "model.checkpoint_recurrence=true"]),
    # Ouro's per-step heads and exit head, RRT's per-recursion deltas (also recomputed) under ZeRO.
    ("tiny_ouro", 2, ["deepspeed.zero_stage=2"]),
    ("tiny_rrt", 2, ["deepspeed.zero_stage=3", "model.checkpoint_recurrence=true"]),
    # Document masks: built from the tokens on every TP rank (SP: over the gathered sequence) and carried
    # between pipeline stages, here with each TP rank's sequence part sent whole (DeepSpeed's default
    # split-and-gather of the stage output over the TP group mixed the ranks' parts under SP).
    ("tiny+documents", 2, ["parallel.tp=2", "parallel.sp=true"]),
    ("tiny+documents", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "deepspeed.zero_stage=1"]),
    # fp32 weights under autocast: megatron's TP linears, ZeRO 3's gathered weights, a pipeline's stages.
    ("tiny+bf16-mixed", 2, ["parallel.tp=2"]),
    # SP under autocast: megatron's Function reduce-scattered a bf16 input gradient into a buffer of the
    # input's dtype (fp32 after a norm), which gloo and NCCL refuse (specs._TorchAutogradWhenLocal).
    ("tiny+bf16-mixed", 2, ["parallel.tp=2", "parallel.sp=true"]),
    ("tiny+bf16-mixed", 2, ["deepspeed.zero_stage=3"]),
    # The embedding alone on the first stage, as split points can put it (and the balanced split does at
    # as many stages as units), and the core on the last (deepspeed_engine.py): one kind of parameter,
    # so one optimizer group where the other stages have two, and ZeRO 1 reduced each group's norm across
    # the stages (every rank waited forever in the first step); and the middle stage takes fp32 in and
    # gives bf16 out, whose gradient DeepSpeed received into its fp32 input buffer (grad norm 50.3 for 1.57).
    ("tiny+bf16-mixed", 3, ["parallel.pp=3", "parallel.pp_split_points=[layer.0,core]", "deepspeed.zero_stage=1"]),
    # An fp32 residual stream under autocast: fp32 into megatron's SP gathers and out of its reduce-scatters
    # (bf16 products added into it), and fp32 sent between stages.
    ("tiny+fp32-residual", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "deepspeed.zero_stage=1"]),
]
STAGES = {"parallel.pp_split_points=[layer.0,core]": "embedding (0%) | layer.0 (12%) | core layer.2 final_norm head"}


@pytest.mark.parametrize("model,procs,layout", LAYOUTS, ids=[f"{m}-{n}p-" + "-".join(a) for m, n, a in LAYOUTS])
def test_layout_matches_one_process(references, pydoc_prefix, tmp_path, model, procs, layout):
    proc = run_cli([*_common(REFERENCES[model][0], pydoc_prefix[0]), *REFERENCES[model][1:], *layout,
                    f"run.dir={tmp_path}"],
                   launcher=[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
                             f"--master_port={next(PORT)}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for option, stages in STAGES.items():
        if option in layout:
            assert f"pipeline stages: {stages}" in proc.stdout, proc.stdout[-2000:]
    got = read_jsonl(tmp_path / "metrics.jsonl")
    want = references[model]
    assert len(got) == len(want) == STEPS + 1
    for g, w in zip(got, want):
        assert g["step"] == w["step"] and g.get("recurrences") == w.get("recurrences")
        rel = TOLERANCE.get(model, 1e-5)
        if "deepspeed.zero_stage=3" in layout:
            rel = TOLERANCE_ZERO3.get(model, rel)
        assert g["loss"] == pytest.approx(w["loss"], rel=rel), (g, w)
        if "grad_norm" in w:
            # The grad norm catches what a few losses would not, e.g. SP norm grads not summed over TP.
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=rel), (g, w)
        # The recurrence diagnostics are over every validation window and every rank's part of it (they
        # were the first micro-batch of the logging rank's share: rank 0's half of each sequence under SP,
        # other windows under DP, none with pipeline stages).
        # A dense model split into pipeline layers has no core to record (one process records its one step).
        if model != "tiny_dense" or "parallel.pp=2" not in layout:
            diagnostics = [k for k in w if k.startswith(("gate_mean_r", "relative_update_r"))]
            assert diagnostics or w.get("split") != "valid", w
            for key in diagnostics:
                assert g.get(key) == pytest.approx(w[key], rel=rel), (key, g, w)


@pytest.mark.parametrize("args,procs,needle", [
    (["parallel.tp=3"], 2, "2 processes cannot be split into parallel.tp=3"),
    (["parallel.tp=2", "model.num_attention_heads=3", "model.hidden_size=96"], 2,
     "model.num_attention_heads=3 is not divisible by parallel.tp=2"),
    (["parallel.sp=true"], 1, "parallel.sp=true needs parallel.tp > 1"),
    (["parallel.tp=2", "deepspeed.zero_stage=3"], 2, "deepspeed.zero_stage=3 needs parallel.tp=1"),
    (["parallel.pp=2", "deepspeed.zero_stage=2"], 2, "cannot be combined with parallel.pp=2"),
    (["parallel.pp=2"], 2, "parallel.pp=2 needs deepspeed.zero_stage=1"),
])
def test_wrong_layout_is_refused_by_the_run_config(args, procs, needle):
    """The layout rules, through the function grt-train refuses with (at `procs` processes): in this process,
    since the launch below shows that grt-train applies them before any process group or data."""
    from grt_megatron.errors import ConfigError
    from grt_megatron.training.config import build_run_config

    cfg = train_config(["model=tiny", "train.iters=1", "run.dir=unused", *args])
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_run_config(cfg, world_size=procs)


def test_wrong_layout_is_refused_at_launch_before_any_group_or_data(tmp_path):
    # A layout that slipped through would hang in a collective for parallel.timeout_minutes (5), past
    # the 240 s given here: refused at start, not after a hang.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={next(PORT)}"]
    proc = run_cli(["model=tiny", "train.iters=1", f"run.dir={tmp_path}", "parallel.timeout_minutes=5", *QUIET,
                    "parallel.tp=3"], launcher=launcher, timeout=240)
    assert proc.returncode != 0
    assert "grt-train: error: 2 processes cannot be split into parallel.tp=3" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "data").exists()  # before any data preparation


def test_data_error_on_rank_0_stops_every_rank(tmp_path):
    """Rank 0 prepares the data; when that fails, the other ranks must fail too, not wait at a barrier.
    A rank left waiting would sit in a collective for parallel.timeout_minutes (5 here), past the 240 s
    this test gives the launch (no wall-clock bound on the normal case, which a busy machine can slow)."""
    proc = run_cli(["model=tiny", "data=/no/such/corpus.txt", "train.iters=1", "train.micro_batch_size=8",
                    "parallel.timeout_minutes=5", f"run.dir={tmp_path}", *QUIET],
                   launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={next(PORT)}"], timeout=240)
    assert proc.returncode != 0
    assert proc.stderr.count("grt-train: error: input '/no/such/corpus.txt': no such file") == 2


def test_srun_style_launch_without_torchrun(references, pydoc_prefix, tmp_path):
    """One task per process as `srun --ntasks=2` starts them: rank and world come from SLURM_* variables."""
    import os
    import subprocess

    from conftest import REPO

    port = next(PORT)
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "grt_megatron.training.cli", *_common("tiny", pydoc_prefix[0]),
             "deepspeed.zero_stage=1", f"run.dir={tmp_path}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    for g, w in zip(read_jsonl(tmp_path / "metrics.jsonl"), references["tiny"]):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
    # Without MASTER_ADDR the tasks could not meet: refused with what to export.
    env = dict(os.environ, SLURM_PROCID="0", SLURM_NTASKS="2")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "grt_megatron.training.cli", *_common("tiny", pydoc_prefix[0]),
                           f"run.dir={tmp_path / 'x'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "export MASTER_ADDR" in proc.stderr, proc.stderr[-2000:]
