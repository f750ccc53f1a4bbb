"""Checkpoint directories without training: commits, manifests, corruption, pruning, config changes, and
refusing files that are not checkpoints (nothing is unpickled)."""

import json
import pickle

import pytest

from grt_megatron.checkpoint.compat import compare_configs
from grt_megatron.checkpoint.store import (
    CheckpointError,
    PendingSave,
    inspect_checkpoint,
    list_checkpoints,
    newest_complete,
    prune,
    resolve_checkpoint,
    supersede_newer,
    write_file,
)


def _save(root, step, payload=b"weights", permanent=False):
    pending = PendingSave(root, step)
    pending.prepare()
    files = {"trainer_state.json": write_file(pending.tmp / "trainer_state.json",
                                              json.dumps({"step": step, "tokens": step * 10}).encode()),
             "model-tp00-pp00.safetensors": write_file(pending.tmp / "model-tp00-pp00.safetensors", payload)}
    return pending.commit(files, permanent)


def test_commit_is_complete_and_latest_moves(tmp_path):
    for step in (1, 2):
        path = _save(tmp_path, step)
    assert path.name == "step_00000002" and (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    info = inspect_checkpoint(path, verify_hashes=True)
    assert info.complete and info.state["tokens"] == 20
    assert not list(tmp_path.glob(".tmp-*"))


def test_unfinished_save_is_never_listed_and_is_cleaned_by_the_next(tmp_path):
    _save(tmp_path, 1)
    killed = PendingSave(tmp_path, 2)
    killed.prepare()
    write_file(killed.tmp / "trainer_state.json", b"{}")  # no manifest: killed mid-save
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    assert newest_complete(tmp_path)[0].step == 1
    _save(tmp_path, 3)
    assert not killed.tmp.exists()


@pytest.mark.parametrize("damage,needle", [
    (lambda p: (p / "model-tp00-pp00.safetensors").write_bytes(b"weightz"), "does not match its sha256"),
    (lambda p: (p / "model-tp00-pp00.safetensors").write_bytes(b"short"), "has 5 bytes, the manifest says 7"),
    (lambda p: (p / "model-tp00-pp00.safetensors").unlink(), "model-tp00-pp00.safetensors is missing"),
    (lambda p: (p / "manifest.json").write_text("{not json"), "the manifest is not valid JSON"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, needle):
    _save(tmp_path, 1)
    damage(_save(tmp_path, 2))
    found, skipped = resolve_checkpoint("auto", tmp_path)
    assert found.step == 1
    assert len(skipped) == 1 and needle in skipped[0].problem
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(")):
        resolve_checkpoint(str(tmp_path / "step_00000002"), tmp_path)


def test_unknown_files_and_folders_are_refused_without_unpickling(tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "model.pt"
    evil.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        resolve_checkpoint(str(evil), tmp_path)
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "step_00000005" / "trainer_state.pt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="not a grt-megatron checkpoint"):
        resolve_checkpoint(str(tmp_path / "step_00000005"), tmp_path)
    (tmp_path / "step_00000005" / "manifest.json").write_text(json.dumps({"format": "deepspeed"}))
    with pytest.raises(CheckpointError, match="manifest format 'deepspeed'"):
        resolve_checkpoint(str(tmp_path / "step_00000005"), tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_checkpoint(str(tmp_path / "nope"), tmp_path)
    assert not marker.exists()
    assert resolve_checkpoint("auto", tmp_path / "empty") == (None, [])


def test_prune_keeps_the_last_k_and_permanent_ones(tmp_path):
    for step in range(1, 7):
        _save(tmp_path, step, permanent=step == 2)
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000003", "step_00000004"]
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 5, 6]


def test_a_prune_killed_midway_leaves_no_half_deleted_checkpoint(tmp_path):
    """Pruning renames a checkpoint out of the `step_N` names before deleting it: killed during the
    deletion, it leaves a dot-directory that is never listed and that the next save removes."""
    for step in (1, 2):
        _save(tmp_path, step)
    killed = tmp_path / ".pruned-step_00000001"
    (tmp_path / "step_00000001").rename(killed)
    (killed / "manifest.json").unlink()  # part of it deleted when the kill came
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    _save(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert [p.name for p in prune(tmp_path, keep_last=1)] == ["step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003"]


def test_resuming_an_older_checkpoint_moves_newer_ones_aside(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    moved = supersede_newer(tmp_path, 1)
    assert sorted(p.name for p in moved) == ["step_00000002", "step_00000003"]
    assert newest_complete(tmp_path)[0].step == 1


def test_config_changes_are_split_into_refused_and_applied():
    saved = {"model": {"hidden_size": 128, "recurrences": 4}, "seed": 1, "train": {"iters": 10, "lr": 1e-3,
             "seq_length": 128, "global_batch_size": 8}, "parallel": {"tp": 1}, "run": {"dir": "a"}, "resume": None}
    new = json.loads(json.dumps(saved))
    new["model"]["recurrences"] = 8
    new["seed"] = 2
    new["train"].update(iters=20, lr=2e-3)
    new["parallel"]["tp"] = 2
    new["run"]["dir"], new["resume"] = "b", "auto"
    refused, applied = compare_configs(saved, new)
    assert refused == ["model.recurrences: 4 -> 8 (the model's shape and math)",
                       "seed: 1 -> 2 (weights' noise, depth draws and the data order are keyed by the seed)"]
    assert applied == ["parallel.tp: 1 -> 2", "train.iters: 10 -> 20", "train.lr: 0.001 -> 0.002"]


def test_verification_is_shared_out_by_bytes_each_file_once():
    from grt_megatron.checkpoint.store import verification_shares

    files = {"a": {"bytes": 100}, "b": {"bytes": 60}, "c": {"bytes": 50}, "d": {"bytes": 10}, "e": {"bytes": 0}}
    shares = verification_shares(files, 2)
    assert sorted(sum(shares, [])) == sorted(files)  # every file, once
    assert shares == [["a", "d", "e"], ["b", "c"]]  # 110 bytes each: largest first to the least loaded
    assert verification_shares(files, 1) == [["a", "b", "c", "d", "e"]]
    assert verification_shares(files, 8)[5:] == [[], [], []]  # more ranks than files: some verify nothing
