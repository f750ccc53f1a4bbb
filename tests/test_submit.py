"""grt-submit checks a run as grt-train would at the job's world size, before anything is written or
submitted; every preset passes at its own size. (Jobs on a real SLURM cluster: tests/test_slurm.py.)"""

import pytest
import yaml

from grt_megatron.launch import submit


def _submit(capsys, tmp_path, *argv):
    code = submit.main(["--run-dir", str(tmp_path / "run"), "--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("preset", sorted(yaml.safe_load(submit.PRESETS.read_text())))
def test_every_preset_passes_at_its_own_world_size(capsys, tmp_path, preset):
    settings = submit.load_presets()[preset]
    code, script, err = _submit(capsys, tmp_path, "--preset", preset, "--", "data=/scratch/corpus")
    assert code == 0, err
    assert f"#SBATCH --nodes={settings['nodes']}" in script
    # The whole node: its memory, 8 cores per GPU process shared by torchrun's 8 processes.
    assert "#SBATCH --mem=0" in script and "#SBATCH --cpus-per-task=64" in script
    assert "export OMP_NUM_THREADS=8" in script
    assert not (tmp_path / "run").exists()


def test_a_global_batch_that_does_not_split_is_refused_with_the_sizes_that_work(capsys, tmp_path):
    code, out, err = _submit(capsys, tmp_path, "--nodes", "1", "--procs-per-node", "8", "--gpus-per-node", "8", "--",
                             "model=medium_dense", "train=paper", "train.micro_batch_size=8")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "grt-submit: error: grt-train would refuse this run on 8 processes: train.global_batch_size=480 is not a "
        "multiple of train.micro_batch_size (8) × data-parallel size 8 (8 processes / tp 1 / pp 1); micro-batch "
        "sizes that work: 1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60"]
    assert not (tmp_path / "run").exists()


def test_the_tiny_recipe_goes_from_one_to_four_processes(capsys, tmp_path):
    """train=cpu's micro-batch is each rank's share of the global batch (16 / DP)."""
    for procs in (1, 2, 4):
        code, _, err = _submit(capsys, tmp_path, "--procs-per-node", str(procs), "--", "model=tiny")
        assert code == 0, err


@pytest.mark.parametrize("args,needle", [
    (["--procs-per-node", "2", "--", "parallel.tp=3"], "2 processes cannot be split into parallel.tp=3"),
    (["--", "model=no_such_model"], "grt-train overrides: In 'train': Could not find 'model/no_such_model'"),
    (["--", "train.lr=abc"], "config key train.lr"),
    (["--procs-per-node", "8", "--gpus-per-node", "4"], "--procs-per-node 8 needs as many GPUs"),
    # written into the script as they came (#SBATCH --time=abc, USR1@-1), or made 1 in silence
    (["--time", "abc"], "--time 'abc': write it as SLURM does, MM, HH:MM:SS or D-HH:MM:SS"),
    (["--signal-seconds", "-1"], "--signal-seconds must be >= 1, got -1"),
    (["--mem", "abc"], "--mem 'abc': a size as sbatch takes it"),
    (["--cpus-per-task", "0"], "--cpus-per-task must be >= 1, got 0"),
])
def test_other_refusals_are_one_line(capsys, tmp_path, args, needle):
    code, out, err = _submit(capsys, tmp_path, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


def test_cpu_jobs_ask_for_one_core_per_process(capsys, tmp_path):
    code, script, _ = _submit(capsys, tmp_path, "--procs-per-node", "2")
    assert code == 0 and "#SBATCH --cpus-per-task=2" in script and "export OMP_NUM_THREADS=1" in script
    assert "--mem" not in script


def test_a_run_dir_that_cannot_hold_the_script_is_one_line(capsys, tmp_path):
    """Without --dry-run the script is written into RUN_DIR/slurm before sbatch: a --run-dir under a file was a
    traceback."""
    (tmp_path / "afile").write_text("x")
    code = submit.main(["--run-dir", str(tmp_path / "afile" / "run"), "--", "model=tiny"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"grt-submit: error: --run-dir {tmp_path / 'afile' / 'run'}: cannot write")
    assert "\n" not in err


def test_data_this_machine_lacks_is_warned_about_not_refused(capsys, tmp_path):
    """A job whose data is missing would wait in the queue and then fail at its start; but a login node may
    not mount what the compute nodes read, so the script is still written."""
    tail = "on this machine; the job will fail at its start unless the compute nodes have it"
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.bin").write_bytes(b"")  # the .idx is missing (an interrupted grt-prepare-data)
    code, script, err = _submit(capsys, tmp_path, "--", "model=tiny", "data=indexed", f"data.prefixes=[{prefix}]")
    assert code == 0 and "#SBATCH" in script
    assert err.strip().splitlines() == [f"grt-submit: warning: data.prefixes[0] {prefix}: {prefix}.idx not found {tail}"]

    (tmp_path / "corpus.idx").write_bytes(b"")
    code, _, err = _submit(capsys, tmp_path, "--", "model=tiny", f"data={prefix}")
    assert code == 0 and err == ""

    code, _, err = _submit(capsys, tmp_path, "--", "model=tiny", f"data={tmp_path}/books.txt",
                           f"data.tokenizer={tmp_path}/tok.model")
    assert code == 0 and err.strip().splitlines() == [
        f"grt-submit: warning: data.source: input '{tmp_path}/books.txt': no such file {tail}",
        f"grt-submit: warning: data.tokenizer {tmp_path}/tok.model: no such file {tail}"]


def test_pipeline_stages_are_printed_before_queueing(capsys, tmp_path, pydoc_prefix):
    """With PP, grt-submit prints the stages grt-train will print at its start (tests/test_parallel_layouts.py
    runs the first layout and reads the same stages), when the vocabulary is known: the head costs 2·d·V."""
    prefix = pydoc_prefix[0]
    pp3 = ["parallel.pp=3", "parallel.pp_split_points=[layer.0,core]", "deepspeed.zero_stage=1"]
    code, script, err = _submit(capsys, tmp_path, "--procs-per-node", "3", "--", "model=tiny", f"data={prefix}",
                                *pp3)
    assert code == 0 and "#SBATCH" in script
    assert err.strip().splitlines() == [
        f"grt-submit: pipeline stages (vocabulary 2048, from {prefix}.tokenizer.model): embedding (0%) | layer.0 "
        "(12%) | core layer.2 final_norm head (88%)"]
    pp2 = ["parallel.pp=2", "deepspeed.zero_stage=1"]
    code, _, err = _submit(capsys, tmp_path, "--procs-per-node", "2", "--", "model=tiny", f"data={prefix}", *pp2,
                           "model.vocab_size=4096")  # a larger head moves the cut: the model's vocabulary counts
    assert code == 0 and err.strip().splitlines() == [
        "grt-submit: pipeline stages (vocabulary 4096, from model.vocab_size): embedding layer.0 core (65%) | "
        "layer.2 final_norm head (35%)"]
    # A tokenizer the job will train: unknown here. A model vocabulary below the prefix tokenizer's: refused.
    code, _, err = _submit(capsys, tmp_path, "--procs-per-node", "2", "--", "model=tiny", "data=builtin:pydoc_topics",
                           *pp2)
    assert code == 0 and err.strip().splitlines() == [
        "grt-submit: pipeline stages: decided at the job's start, when its tokenizer is known (the head's cost is "
        "2·d·V)"]
    code, out, err = _submit(capsys, tmp_path, "--procs-per-node", "2", "--", "model=tiny", f"data={prefix}", *pp2,
                             "model.vocab_size=1000")
    assert code == 2 and out == "" and err.strip().splitlines() == [
        "grt-submit: error: grt-train would refuse this run: model.vocab_size=1000 is smaller than the tokenizer's "
        "vocabulary (2048)"]
    code, _, err = _submit(capsys, tmp_path, "--", "model=tiny", f"data={prefix}")
    assert code == 0 and err == ""  # no PP, no stages
