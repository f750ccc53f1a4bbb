"""Non-finite steps are skipped (no update, no LR advance) the same way in every layout; too many in a
row stop the run with exit 3; a checkpoint is never written from non-finite state; metrics.jsonl stays
strict JSON; `train.grad_clip=0` means no clipping everywhere."""

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import BF16_SHORT, read_jsonl, run_cli

QUIET = ["logging.wandb=disabled", "logging.progress=false"]
RECIPE = dict(hidden_size=64, num_attention_heads=4, max_sequence_length=32, prelude_layers=1, core_layers=1,
              coda_layers=1, recurrences=2, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)


def _strict(path):
    """Every line parses as JSON without NaN/Infinity (Python's json accepts them unless told not to)."""
    def refuse(name):
        raise AssertionError(f"{path}: bare {name} in metrics.jsonl")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines() if line.strip()]


ENGINES = [("fp32", 0, "fp32"), ("fp32", 1, "fp32"), ("fp32", 2, "fp32"), ("fp32", 3, "fp32"),
           ("bf16", 0, "fp32"), ("bf16", 0, "bf16"), ("bf16", 2, "fp32"), ("bf16-mixed", 0, "fp32")]


@pytest.mark.parametrize("precision,zero_stage,accum", ENGINES, ids=[f"{p}-zero{z}-accum{a}" for p, z, a in ENGINES])
def test_nonfinite_gradients_change_nothing_in_every_optimizer_path(world, precision, zero_stage, accum):
    """DeepSpeed's bare optimizer (guarded by us), its BF16 and fp16-style bf16 wrappers and ZeRO 1-3:
    a step with NaN gradients leaves the fp32 weights, the Adam moments and the LR schedule as they were,
    and the next finite step is applied."""
    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.training.config import build_run_config
    from grt_megatron.parallel.deepspeed_engine import build_engine
    from grt_megatron.training.step_guard import install_step_guard, master_weights, weights_are_finite

    run = build_run_config({"model": RECIPE, "data": {"source": "unused"},
                            "train": {"precision": precision, "micro_batch_size": 2, "global_batch_size": 2,
                                      "grad_clip": 1.0, "warmup_iters": 2},
                            "deepspeed": {"zero_stage": zero_stage, "grad_accum_dtype": accum}}, world_size=1)
    engine = build_engine(GRTLanguageModel(run.model_config(300), init_seed=0), run, dp_size=1)
    install_step_guard(engine)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))

    def state():
        opt = engine.basic_optimizer
        params = [p.detach().clone() for p in master_weights(engine)]
        assert params and sum(p.numel() for p in params) >= 64 * 300  # the real weights, not empty groups
        moments = [t.detach().clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return params, moments, engine.lr_scheduler.last_epoch

    def step(poison):
        loss = engine(tokens, tokens).mean()
        engine.backward(loss * float("nan") if poison else loss)
        engine.step()
        return engine.was_step_applied()

    assert step(poison=False)  # a first real step, so that Adam has moments
    before = state()
    assert not step(poison=True)
    after = state()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert len(before[1]) == len(after[1]) > 0 and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    assert before[2] == after[2]  # the LR schedule did not advance
    assert step(poison=False)
    assert not all(torch.equal(a, b) for a, b in zip(before[0], state()[0]))
    assert weights_are_finite(engine)
    with torch.no_grad():
        master_weights(engine)[0].view(-1)[0] = float("inf")
    assert not weights_are_finite(engine)


def _args(prefix, iters, extra=()):
    return ["model=tiny", f"data={prefix}", f"train.iters={iters}", f"train.eval_interval={iters}",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_iters=1", *QUIET, *extra]


def test_diverging_run_skips_then_stops_with_exit_3_and_keeps_good_checkpoints(pydoc_prefix, tmp_path):
    """lr 1e3: the loss blows up from step 2. The skipped steps are logged as strict JSON, the run stops
    with exit 3 after max_skipped_steps + 1 in a row, and every checkpoint left holds finite weights,
    including the last one from before the streak (interval saves wait while steps are being skipped)."""
    run_dir = tmp_path / "run"
    proc = run_cli([*_args(pydoc_prefix[0], 20, ["train.lr=1e3", "train.warmup_iters=1", "train.max_skipped_steps=3",
                                                "checkpoint.interval=1", "checkpoint.keep_last=2"]),
                    f"run.dir={run_dir}"])
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("grt-train: error:")]
    assert len(errors) == 1 and "4 steps in a row" in errors[0] and "train.max_skipped_steps=3" in errors[0]
    assert "Traceback" not in proc.stderr
    records = _strict(run_dir / "metrics.jsonl")
    skipped = [r for r in records if r.get("skipped")]
    assert len(skipped) == 4 and skipped[-1]["skipped_steps"] == 4
    assert f"step {skipped[-1]['step']}:" in errors[0]
    first_bad = skipped[0]["step"]
    for r in skipped:
        assert r["skip_reason"] in ("non-finite grad norm", "non-finite loss")
        assert r["grad_norm"] is None and "grad_norm" in r["nonfinite"]
        assert r["lr"] == skipped[0]["lr"]  # a skipped step does not advance the schedule
    steps = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps and max(steps) == first_bad - 1  # nothing saved during the streak; the last good one kept
    for step in steps:
        for shard in (run_dir / "checkpoints" / f"step_{step:08d}").glob("*.safetensors"):
            assert all(torch.isfinite(t).all() for t in load_file(shard).values()), shard


LAYOUTS = [(2, ["deepspeed.zero_stage=2"]), (2, ["deepspeed.zero_stage=3"])]
PORT = iter(range(29850, 29870))


@pytest.fixture(scope="module")
def injected_reference(pydoc_prefix, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nan") / "one"
    proc = run_cli([*_args(pydoc_prefix[0], 5, ["train.inject_nan_at=[3]", "train.grad_clip=0"]), f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _strict(run_dir / "metrics.jsonl")


def test_injected_nan_step_is_skipped_and_the_run_goes_on(injected_reference):
    steps = [r for r in injected_reference if "split" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert steps[2]["skipped"] and steps[2]["skip_reason"] == "injected NaN (train.inject_nan_at)"
    assert steps[3]["lr"] == steps[2]["lr"] > steps[1]["lr"]  # the schedule waits one step
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps if r is not steps[2])
    assert not any(r.get("skipped") for r in steps if r is not steps[2])


def test_injected_nan_step_is_skipped_under_bf16_mixed(pydoc_prefix, tmp_path):
    """The trainer's guard decides from the norm it measured (one read): the NaN step is skipped, the
    schedule waits, the steps around it are finite."""
    proc = run_cli([*_args(pydoc_prefix[0], 5, ["train.inject_nan_at=[3]", "train.precision=bf16-mixed", *BF16_SHORT]),
                    f"run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in _strict(tmp_path / "metrics.jsonl") if "split" not in r]
    assert [bool(r.get("skipped")) for r in steps] == [False, False, True, False, False]
    assert steps[3]["lr"] == steps[2]["lr"] > steps[1]["lr"]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps if r is not steps[2])


@pytest.mark.parametrize("procs,layout", LAYOUTS, ids=["-".join(a) for _, a in LAYOUTS])
def test_skip_and_no_clipping_agree_across_layouts(injected_reference, pydoc_prefix, tmp_path, procs, layout):
    """With train.grad_clip=0 (no clipping: DeepSpeed's meaning of 0, and ours on every path) and an
    injected NaN step, ZeRO 2 and 3 on two ranks give one process's curve (fp32 ZeRO 0, clipped by us)."""
    proc = run_cli([*_args(pydoc_prefix[0], 5, ["train.inject_nan_at=[3]", "train.grad_clip=0"]), *layout,
                    f"run.dir={tmp_path}"],
                   launcher=[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
                             f"--master_port={next(PORT)}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _strict(tmp_path / "metrics.jsonl")
    assert len(got) == len(injected_reference)
    for a, b in zip(got, injected_reference):
        assert (a["step"], a.get("split"), a.get("skipped")) == (b["step"], b.get("split"), b.get("skipped"))
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        if b.get("grad_norm") is not None:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_grad_clip_zero_is_off_and_differs_from_clipping(injected_reference, pydoc_prefix, tmp_path):
    """The reference above runs with grad_clip=0: had 0 zeroed the gradients (what it did without ZeRO),
    its loss would not move; clipping hard changes the curve from step 2 on."""
    from grt_megatron.training.config import build_run_config
    from grt_megatron.parallel.deepspeed_engine import deepspeed_config

    proc = run_cli([*_args(pydoc_prefix[0], 5, ["train.inject_nan_at=[3]", "train.grad_clip=0.05"]),
                    f"run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    tight = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "split" not in r]
    off = [r["loss"] for r in injected_reference if "split" not in r]
    assert off[0] == tight[0] and off[1] != tight[1] and off[4] < off[0] - 0.05
    for clip in (0, None):  # DeepSpeed's 0 is "off" too
        run = build_run_config({"model": RECIPE, "data": {"source": "unused"}, "train": {"grad_clip": clip,
                                "micro_batch_size": 2, "global_batch_size": 2}}, world_size=1)
        assert deepspeed_config(run, 1)["gradient_clipping"] == 0.0


def test_loss_spike_detector():
    from grt_megatron.training.step_guard import LossSpikeDetector

    detector = LossSpikeDetector(factor=2.0, window=20)
    assert [detector.check(3.0 + 0.01 * i) for i in range(12)] == [None] * 12
    assert detector.check(7.0) == "loss spike"  # above 2 × the median (~3.05)
    assert len(detector.history) == 12  # a spike does not join the window
    assert detector.check(float("nan")) == "non-finite loss"
    assert detector.check(5.0) is None
    resumed = LossSpikeDetector(factor=2.0, window=20, history=detector.history)
    assert resumed.check(7.0) == detector.check(7.0) == "loss spike"
    assert LossSpikeDetector(factor=None, window=20).check(1e9) is None  # off: only non-finite losses count


def test_metrics_records_are_strict_json(tmp_path):
    from grt_megatron.training.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, True, "disabled", "p", None, {})
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    logger.close()
    (record,) = _strict(tmp_path / "metrics.jsonl")
    assert record == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3,
                      "nonfinite": {"loss": "nan", "grad_norm": "inf"}}
