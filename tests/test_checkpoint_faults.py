"""A save that cannot be written (full disk, no permission, read-only or failing storage): one line naming
the checkpoint and what it needs, nothing partial left, `latest` and earlier checkpoints untouched, and
with several ranks every rank raises the same error instead of waiting for the one that failed."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli
from test_checkpoint_resume import _args, _curve

def _engine(world_size: int = 1):
    """A tiny fp32 model under DeepSpeed, as the trainer builds it (the optimizer stepped once, so that the
    checkpoint holds Adam moments too)."""
    import torch

    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.training.config import build_run_config
    from grt_megatron.parallel.deepspeed_engine import build_engine

    model = dict(hidden_size=64, num_attention_heads=4, max_sequence_length=32, prelude_layers=1, core_layers=1,
                 coda_layers=1, recurrences=2, add_bias_linear=False)
    run = build_run_config({"model": model, "data": {"source": "unused"},
                            "train": {"micro_batch_size": 2, "global_batch_size": 2 * world_size}},
                           world_size=world_size)
    engine = build_engine(GRTLanguageModel(run.model_config(300), init_seed=0), run, dp_size=world_size)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(tokens, tokens).mean())
    engine.step()
    return engine


class _Tokenizer:
    """What a save needs of a tokenizer: a file name, `save` (written as the sentencepiece one writes it:
    a temporary file renamed) and, for the size estimate, its bytes."""

    file_name = "tokenizer.model"
    model_proto = b"\x01" * 4000

    def save(self, path: Path) -> Path:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.model_proto)
        os.replace(tmp, path)
        return path


def _save(engine, root: Path, step: int, keep_last: int = 10) -> Path:
    from grt_megatron.checkpoint import save_checkpoint

    return save_checkpoint(root, step, engine, False, _Tokenizer(), {"step": step, "tokens": step * 64}, keep_last)


def _inject(mp: pytest.MonkeyPatch, action: str, name: str, code: int) -> None:
    """Make the save fail with errno `code` where it does `action` (write, mkdir, rename) to the path named
    `name`. A file is half-written first, as on a disk that fills up."""
    from grt_megatron.checkpoint import checkpointer, store

    def fail(path):
        raise OSError(code, os.strerror(code), str(path))

    real = {"write": store.write_file, "stream": store.write_stream, "mkdir": Path.mkdir, "rename": os.rename,
            "replace": os.replace}

    def write_file(path, data):
        if action == "write" and path.name == name:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[: len(data) // 2])
            fail(path)
        return real["write"](path, data)

    def write_stream(path, chunks):  # the tensor files: written as a stream of chunks
        if action == "write" and path.name == name:
            return write_file(path, b"".join(bytes(memoryview(c).cast("B")) for c in chunks))
        return real["stream"](path, chunks)

    def mkdir(self, *args, **kwargs):
        if action == "mkdir" and self.name == name:
            fail(self)
        return real["mkdir"](self, *args, **kwargs)

    def renamer(kind):
        def rename(src, dst):
            if action == "rename" and Path(src).name == name:
                fail(src)
            return real[kind](src, dst)
        return rename

    for module in (store, checkpointer):
        mp.setattr(module, "write_file", write_file)
        mp.setattr(module, "write_stream", write_stream)
    mp.setattr(Path, "mkdir", mkdir)
    mp.setattr(os, "rename", renamer("rename"))
    mp.setattr(os, "replace", renamer("replace"))


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


def _assert_only(root: Path, *checkpoints: str) -> None:
    """`root` holds these complete checkpoints and `latest` naming the newest: nothing partial."""
    from grt_megatron.checkpoint import inspect_checkpoint

    assert sorted(p.name for p in root.iterdir()) == sorted(["latest", *checkpoints])
    assert (root / "latest").read_text().strip() == max(checkpoints)
    for name in checkpoints:
        assert inspect_checkpoint(root / name, verify_hashes=True).complete


@pytest.fixture(scope="module")
def engine(world):
    return _engine()


FAULTS = [  # (what fails, on which path, errno, what the one line says after the checkpoint's name and root)
    ("write", "model-tp00-pp00.safetensors", errno.ENOSPC, r"no space left on device \(needs about (.+), .+ free\)"),
    ("write", "rank00000.safetensors", errno.EDQUOT, r"disk quota exceeded \(needs about (.+), .+ free\)"),
    ("rename", "tokenizer.model.tmp", errno.EIO, r"input/output error \(\S+/tokenizer.model.tmp; needs about (.+)\)"),
    ("mkdir", ".tmp-step_00000002", errno.EACCES, r"permission denied \(\S+/.tmp-step_00000002; needs about (.+)\)"),
    ("write", "manifest.json", errno.ENOSPC, r"no space left on device \(needs about (.+), .+ free\)"),
    ("rename", ".tmp-step_00000002", errno.EROFS, r"read-only file system \(\S+; needs about (.+)\)"),
    ("write", ".latest.tmp", errno.ENOSPC, r"no space left on device \(needs about (.+), .+ free\)"),
]


@pytest.mark.parametrize("action,name,code,says", FAULTS,
                         ids=[f"{a}-{n.strip('.')}-{errno.errorcode[c]}" for a, n, c, _ in FAULTS])
def test_a_failed_save_says_why_in_one_line_and_leaves_the_previous_checkpoint(engine, tmp_path, action, name, code,
                                                                               says):
    """Writing a shard, the RNG states, the tokenizer; making the temporary directory; the commit's manifest,
    rename and `latest`: each failure undoes the save."""
    from grt_megatron.checkpoint import CheckpointWriteError, inspect_checkpoint

    root = tmp_path / "checkpoints"
    previous = _save(engine, root, 1)
    with pytest.MonkeyPatch.context() as mp:
        _inject(mp, action, name, code)
        with pytest.raises(CheckpointWriteError) as caught:
            _save(engine, root, 2)
    message = str(caught.value)
    match = re.fullmatch(rf"could not write checkpoint step_00000002 under {re.escape(str(root))}: {says}", message)
    assert match, message
    # "About" the checkpoint's size: the previous checkpoint of the same model is as large.
    assert _bytes(match.group(1)) == pytest.approx(inspect_checkpoint(previous).bytes, rel=0.05)
    _assert_only(root, "step_00000001")
    _save(engine, root, 2)  # the failure left nothing behind that stops the next save
    _assert_only(root, "step_00000001", "step_00000002")


def test_a_failed_resave_of_the_same_step_puts_the_saved_one_back(engine, tmp_path):
    """A resumed run saving a step again moves the old copy aside first: a failure moves it back."""
    from grt_megatron.checkpoint import CheckpointWriteError

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _save(engine, root, step)
    with pytest.MonkeyPatch.context() as mp:
        _inject(mp, "rename", ".tmp-step_00000002", errno.EIO)  # renaming the new copy into place
        with pytest.raises(CheckpointWriteError, match="input/output error"):
            _save(engine, root, 2)
    _assert_only(root, "step_00000001", "step_00000002")


# ---- two ranks --------------------------------------------------------------------------------------------
TWO_RANK_FAULTS = [  # (step, the failing rank, what fails, on which path, errno)
    (2, 1, "write", "rank00001.safetensors", errno.ENOSPC),  # not the committing rank, while writing
    (3, 0, "write", "model-tp00-pp00.safetensors", errno.EIO),  # rank 0 while writing; rank 1 wrote its file
    (4, 0, "mkdir", ".tmp-step_00000004", errno.EACCES),  # rank 0 making the directory, before the others write
    (5, 0, "write", "manifest.json", errno.ENOSPC),  # rank 0 committing, after every rank wrote
]


def _two_rank_worker(root: Path) -> None:
    """One of two ranks (torchrun this file): save, fail the TWO_RANK_FAULTS on one rank, save again; write
    the errors this rank raised to `root/../rankN.json`."""
    import torch.distributed as dist

    from grt_megatron.checkpoint import CheckpointWriteError
    from grt_megatron.distributed import init_distributed

    init_distributed(seed=0, timeout_minutes=1)  # a rank left waiting fails the test in a minute, not never
    engine, rank = _engine(world_size=2), dist.get_rank()
    _save(engine, root, 1)
    errors = {}
    for step, failing, action, name, code in TWO_RANK_FAULTS:
        with pytest.MonkeyPatch.context() as mp:
            if rank == failing:
                _inject(mp, action, name, code)
            try:
                _save(engine, root, step)
            except CheckpointWriteError as err:
                errors[step] = str(err)
    _save(engine, root, 6)
    (root.parent / f"rank{rank}.json").write_text(json.dumps(errors))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_cannot_write_fails_every_rank_with_the_same_error(tmp_path):
    root = tmp_path / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", __file__, str(root)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert errors[0] == errors[1]  # the same error on every rank
    assert sorted(errors[0]) == ["2", "3", "4", "5"]
    prefix = f"could not write checkpoint step_0000000{{}} under {root}: "
    assert errors[0]["2"].startswith(prefix.format(2) + "no space left on device on rank 1 (needs about ")
    assert errors[0]["3"].startswith(prefix.format(3) + "input/output error on rank 0 (")
    assert errors[0]["4"].startswith(prefix.format(4) + "permission denied on rank 0 (")
    assert errors[0]["5"].startswith(prefix.format(5) + "no space left on device on rank 0 (needs about ")
    _assert_only(root, "step_00000001", "step_00000006")


# ---- a real full disk -----------------------------------------------------------------------------------
# A tiny model's checkpoint (model=tiny, the 2048-piece pydoc tokenizer) is 11.5 MB, measured: two fit on
# this disk, the third does not.
TINY_CHECKPOINT_BYTES = 11_522_671
DISK_BYTES = int(2.5 * TINY_CHECKPOINT_BYTES)


def _mount_tmpfs(path: Path, size: int) -> None:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")


def test_a_full_disk_stops_grt_train_with_exit_4_and_the_run_resumes_elsewhere(pydoc_prefix, tmp_path):
    from grt_megatron.checkpoint import inspect_checkpoint

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, DISK_BYTES)
    try:
        args = _args(pydoc_prefix[0], iters=4, interval=1, extra=["checkpoint.keep_last=10"])
        full = run_cli([*args, f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={disk}"])
        lines = full.stderr.strip().splitlines()
        assert "Traceback" not in full.stderr, full.stderr[-3000:]
        said = rf"could not write checkpoint step_00000003 under {re.escape(str(disk))}: no space left on device"
        assert re.fullmatch(rf"grt-train: error: {said} \(needs about 11 MiB, [\d.]+ MiB free\)", lines[-1]), lines[-1]
        assert sorted(p.name for p in disk.iterdir()) == ["latest", "step_00000001", "step_00000002"]
        newest = inspect_checkpoint(disk / "step_00000002", verify_hashes=True)
        assert newest.complete and (disk / "latest").read_text().strip() == "step_00000002"
        # Room elsewhere: the newest checkpoint continues the run where it stopped, bit for bit.
        resumed = tmp_path / "resumed"
        proc = run_cli([*args, f"run.dir={resumed}", f"resume={newest.path}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _curve(resumed)[0] == _curve(tmp_path / "run", after=2)[0]  # step 3, as the stopped run had it
        assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if r.get("split") is None] == [3, 4]
        assert full.returncode == 4, f"exit code {full.returncode} (all else as expected: {lines[-1]})"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


if __name__ == "__main__":  # a rank of test_a_rank_that_cannot_write_fails_every_rank_with_the_same_error
    _two_rank_worker(Path(sys.argv[1]))
