"""`grt-train` end to end, as users run it: a plain python process, torchrun, and bad input."""

import json
import math
import sys

import pytest

from conftest import BF16_SHORT, SHAKESPEARE, read_jsonl, run_cli, train_config

QUIET = ["logging.wandb=disabled", "logging.progress=false"]
STEP_KEYS = {"step", "loss", "grad_norm", "lr", "recurrences", "grad_recurrences", "tokens", "tokens_per_s",
             "flops_per_s", "step_seconds"}


@pytest.fixture(scope="module")
def shakespeare_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    proc = run_cli(["model=tiny", f"data={SHAKESPEARE}", "data.vocab_size=2048", "train.iters=48", "train.eval_interval=24",
                    f"run.dir={run_dir}", "seed=3", "train.sample_tokens=20", *QUIET])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_loss_falls_on_real_text(shakespeare_run):
    run_dir, _ = shakespeare_run
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "split" not in r]
    valid = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "valid"]
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    assert first == pytest.approx(math.log(2048), abs=0.2)  # uniform over the vocabulary at init
    assert last < first - 1.5, (first, last)
    assert valid[-1]["loss"] < valid[0]["loss"] < first


def test_metrics_jsonl_is_complete(shakespeare_run):
    run_dir, proc = shakespeare_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "split" not in r]
    assert [r["step"] for r in steps] == list(range(1, 49))
    for r in steps:
        assert STEP_KEYS <= r.keys()
        assert isinstance(r["loss"], float) and math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert 1 <= r["recurrences"] <= 4 and r["tokens"] == r["step"] * 16 * 128
        assert r["tokens_per_s"] > 0 and r["flops_per_s"] > 0
    assert len({r["recurrences"] for r in steps}) == 4  # uniform sampler covers 1..R
    assert steps[0]["lr"] < steps[29]["lr"]  # warmup
    valid = [r for r in records if r.get("split") == "valid"]
    assert [r["step"] for r in valid] == [24, 48] and all(r["recurrences"] == 4 for r in valid)
    for r in valid:  # gate diagnostics per recurrence: the gate starts near sigmoid(4) and the state moves
        gates = [r[f"gate_mean_r{i}"] for i in range(1, 5)]
        assert all(0.5 < g < 1 for g in gates) and all(r[f"relative_update_r{i}"] > 0 for i in range(1, 5))
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["model_shape"] == "1+1x4+1" and info["parameters"] > 0
    assert len(info["tokenizer"]["sha256"]) == 64 and info["tokenizer"]["vocab_size"] == 2048
    assert info["data_prefixes"] == [str(run_dir / "data" / "corpus")]
    assert (run_dir / "data" / "corpus.idx").is_file()  # the raw corpus went through grt-prepare-data's path
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "tokenizer.model").is_file()
    assert "sample:" in proc.stdout and "valid loss" in proc.stdout


def test_torchrun_data_parallel_matches_one_process(tmp_path, pydoc_prefix):
    """DP 2 (micro 4) under torchrun and one plain process (micro 8) see the same samples with the same
    noise: per-step losses agree to float rounding and evaluation is identical."""
    common = ["model=tiny", f"data={pydoc_prefix[0]}", "train.iters=6", "train.eval_interval=6",
              "train.global_batch_size=16", *QUIET]
    one = run_cli([*common, "train.micro_batch_size=8", f"run.dir={tmp_path / 'one'}"])
    two = run_cli([*common, "train.micro_batch_size=4", f"run.dir={tmp_path / 'two'}"],
                  launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                            "--master_port=29561"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(a) == len(b) == 7
    for x, y in zip(a, b):
        assert x["step"] == y["step"] and x.get("recurrences") == y.get("recurrences")
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-6)
        if "grad_norm" in x:
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_bf16_dense_deepspeed_optimizer_and_offline_wandb(tmp_path):
    # On the default data (the built-in corpus, prepared at the run's start), as `grt-train` runs without `data=`.
    proc = run_cli(["model=tiny_dense", "train.iters=4", "train.precision=bf16", "train.optimizer=deepspeed",
                    "train.torch_adam=true", *BF16_SHORT, "train.eval_iters=1", f"run.dir={tmp_path}",
                    "logging.wandb=offline", "logging.progress=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    from grt_megatron.device import cpu_has_fast_bf16_matmuls

    # bf16 on a CPU without AVX-512 is slow, and the run's log says so (on this machine or not).
    assert ("train.precision=bf16 on a CPU without AVX-512" in proc.stdout) != cpu_has_fast_bf16_matmuls()
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "split" not in r]
    assert len(steps) == 4 and all(r["recurrences"] == 1 and r["grad_norm"] > 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0  # a real wandb run, syncable later


def test_fused_adam_trains_as_the_default_adam_within_rounding(tmp_path, pydoc_prefix):
    """torch's fused AdamW and its default implementation compute the same update (other rounding)."""
    curves = {}
    for fused in ("false", "true"):
        proc = run_cli(["model=tiny", f"data={pydoc_prefix[0]}", "train.iters=4", "train.precision=bf16", f"train.fused_adam={fused}",
                        *BF16_SHORT, "train.eval_iters=1", f"run.dir={tmp_path / fused}", *QUIET])
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves[fused] = [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(tmp_path / fused / "metrics.jsonl")
                         if "split" not in r]
    assert [s for s, _, _ in curves["true"]] == [1, 2, 3, 4]
    assert curves["true"][0] == curves["false"][0]  # the first loss comes before any update
    for (_, a, ga), (_, b, gb) in zip(curves["true"], curves["false"]):
        assert a == pytest.approx(b, rel=1e-3) and ga == pytest.approx(gb, rel=1e-2)


@pytest.mark.parametrize("args,needle", [
    (["train.precision=fp16"], "train.precision='fp16' is not one of fp32, bf16"),
    (["data=/no/such/file.txt"], "input '/no/such/file.txt': no such file"),
    (["model.vocab_size=100", "data=PYDOC"], "model.vocab_size=100 is smaller than the tokenizer's vocabulary (2048)"),
    (["data=indexed", "data.prefixes=[/no/such/prefix]"], "/no/such/prefix.idx not found"),
])
def test_bad_input_is_one_clear_line(tmp_path, pydoc_prefix, args, needle):
    """A bad setting, a missing input, a tokenizer that does not fit: one line, exit 2, nothing written."""
    args = [a.replace("PYDOC", str(pydoc_prefix[0])) for a in args]  # prepared once, not per run
    proc = run_cli(["model=tiny", "train.iters=2", f"run.dir={tmp_path / 'run'}", *QUIET, *args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("grt-train: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args,needle", [
    (["+train.iterz=3"], "config key train.iterz"),
    (["model.gate=lstm"], "model.gate='lstm' is not one of mlp, none"),
    (["train.global_batch_size=12", "train.micro_batch_size=8"], "train.global_batch_size=12 is not a multiple"),
    (["train.lr=-1"], "train.lr=-1.0 is not valid: it must be a finite number > 0"),
    (["train.lr=nan"], "train.lr=nan is not valid"),
    (["train.beta1=1.5"], "train.beta1=1.5 is not valid: it must be in [0, 1)"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0 is not valid: it must be a finite number >= 0 (0 or null: no"),
    (["model.hidden_size=-128"], "model.hidden_size must be >= 1, got -128"),
    (["train.skip_loss_spikes=true"], "train.skip_loss_spikes=true needs train.loss_spike_factor"),
    (["train.fused_adam=true", "train.optimizer=deepspeed"], "train.fused_adam=true applies to train.optimizer=torch"),
    (["train.optimizer=deepspeed"], "train.optimizer=deepspeed needs train.torch_adam=true"),
    # Once accepted in silence: a run at another length than recorded, an LR that climbs, negative MFU.
    (["train.seq_length=0"], "train.seq_length must be >= 1 (or null: model.max_sequence_length), got 0"),
    (["train.lr=0.001", "train.min_lr=0.05"], "train.min_lr=0.05 is not valid: it must be a finite number >= 0 "
                                              "and <= train.lr=0.001"),
    (["logging.peak_tflops=-1"], "logging.peak_tflops must be a finite number > 0"),
    (["data.train_samples=0"], "data.train_samples must be >= 1"),
    (["train.sample_tokens=-5"], "train.sample_tokens must be >= 0"),
    (["seed=-1"], "seed must be in [0, 2**32), got -1"),
    (["data.valid_seed=-1"], "data.valid_seed must be in [0, 2**32), got -1"),
])
def test_bad_setting_is_refused_by_the_run_config(args, needle):
    """The settings grt-train refuses through `build_run_config` (the ConfigError it prints as its one line,
    as the first case above shows end to end), checked in this process: a launch each would add nothing."""
    from grt_megatron.errors import ConfigError
    from grt_megatron.training.config import build_run_config

    cfg = train_config(["model=tiny", "train.iters=2", "run.dir=unused", *args])
    with pytest.raises(ConfigError) as refused:
        build_run_config(cfg, world_size=1)
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_truncated_prefix_is_refused(tmp_path, pydoc_prefix):
    import shutil

    for suffix in (".bin", ".idx", ".meta.json", ".tokenizer.model"):
        shutil.copy(str(pydoc_prefix[0]) + suffix, str(tmp_path / "cut") + suffix)
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(4096)
    proc = run_cli(["model=tiny", f"data={tmp_path / 'cut'}", "train.iters=2", f"run.dir={tmp_path / 'run'}", *QUIET])
    assert proc.returncode == 2 and "cut.bin has 4096 bytes but" in proc.stderr, proc.stderr[-2000:]


def test_existing_run_dir_is_refused(shakespeare_run):
    run_dir, _ = shakespeare_run
    before = (run_dir / "metrics.jsonl").read_bytes()
    proc = run_cli(["model=tiny", "train.iters=2", f"run.dir={run_dir}", *QUIET])
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before


@pytest.fixture(scope="module")
def zero0_run(tmp_path_factory, pydoc_prefix):
    run_dir = tmp_path_factory.mktemp("zero") / "zero0"
    proc = run_cli(["model=tiny", f"data={pydoc_prefix[0]}", "train.iters=3", f"run.dir={run_dir}", *QUIET])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_stage_0_in_one_process(tmp_path, pydoc_prefix, zero0_run, stage):
    proc = run_cli(["model=tiny", f"data={pydoc_prefix[0]}", "train.iters=3", f"deepspeed.zero_stage={stage}", f"run.dir={tmp_path}", *QUIET])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for x, y in zip(zero0_run, read_jsonl(tmp_path / "metrics.jsonl")):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
        if "grad_norm" in x:
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
