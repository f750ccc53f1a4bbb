"""grt-prepare-data: Megatron indexed datasets that round-trip, atomic output, one clear line per bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, SHAKESPEARE, SHARED_DATA, run_prepare
from grt_megatron.data import DataError, load_documents, load_tokenizer
from grt_megatron.data.indexed import prefix_paths, verify_prefix


def _outputs(folder):
    return sorted(p.name for p in folder.iterdir())


def test_megatron_reads_back_every_document(pydoc_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, summary = pydoc_prefix
    tok = load_tokenizer(prefix_paths(prefix)["tokenizer"])
    ds = IndexedDataset(str(prefix))  # megatron-core's own reader (the same format as Megatron-LM's)
    docs = load_documents("builtin:pydoc_topics")
    assert len(ds) == summary.documents == len(docs)
    assert int(ds.sequence_lengths.sum()) == summary.tokens
    assert ds.index.dtype == np.uint16  # 2048 ids fit
    for i in (0, 7, len(docs) - 1):
        ids = ds[i]
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == docs[i]  # text → tokens → text
    meta = json.loads(prefix_paths(prefix)["meta"].read_text())
    assert meta["tokens"] == summary.tokens and meta["tokenizer"]["sha256"] == tok.identity
    assert verify_prefix(prefix, tok.identity)["documents"] == summary.documents


def test_cli_round_trip_with_workers_and_given_tokenizer(tmp_path, pydoc_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = prefix_paths(pydoc_prefix[0])["tokenizer"]
    prefix = tmp_path / "shakespeare"
    proc = run_prepare(["--input", str(SHAKESPEARE), "--output-prefix", str(prefix), "--tokenizer", str(tokenizer),
                        "--workers", "2", "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "documents" in proc.stdout and "tokens/s" in proc.stdout
    tok = load_tokenizer(tokenizer)
    ds = IndexedDataset(str(prefix))
    docs = load_documents(str(SHAKESPEARE))
    assert len(ds) == len(docs)
    text = "\n\n".join(tok.decode(ds[i][:-1]) for i in range(len(ds)))
    assert text == "\n\n".join(docs)  # the normalized source, whole
    assert not prefix_paths(prefix)["tokenizer"].exists()  # only a trained tokenizer is written


def test_inputs_mix(tmp_path, pydoc_prefix):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"t": f"record {i}"}) + "\n" for i in range(5)))
    prefix = tmp_path / "mix"
    proc = run_prepare(["--input", str(jsonl), "--input", str(SHAKESPEARE), "--json-key", "t", "--output-prefix",
                        str(prefix), "--tokenizer", str(prefix_paths(pydoc_prefix[0])["tokenizer"]), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(prefix_paths(prefix)["meta"].read_text())["documents"] == 5 + len(load_documents(str(SHAKESPEARE)))


@pytest.mark.parametrize("setup,args,needle", [
    (None, ["--input", "{tmp}/missing.txt"], "input '{tmp}/missing.txt': no such file"),
    ("empty", ["--input", "{tmp}/empty.txt"], "the corpus is empty"),
    ("badjson", ["--input", "{tmp}/bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    ("nokey", ["--input", "{tmp}/nokey.jsonl"], "nokey.jsonl:2: no 'text' key"),
    ("latin1", ["--input", "{tmp}/latin1.txt"], "latin1.txt: not UTF-8 (byte 5)"),
    ("exists", ["--input", str(SHAKESPEARE)], "out.bin exists; refusing to overwrite it (pass --overwrite)"),
])
def test_bad_input_one_line_and_no_output(tmp_path, setup, args, needle):
    files = {
        "empty": ("empty.txt", b"\n\n  \n"),
        "badjson": ("bad.jsonl", b'{"text": "fine"}\n{"text": oops}\n'),
        "nokey": ("nokey.jsonl", b'{"text": "fine"}\n{"body": "x"}\n'),
        "latin1": ("latin1.txt", "caf\u00e9 and na\u00efve".encode("latin-1")[:0] + b"hello\xe9world"),
    }
    if setup in files:
        name, content = files[setup]
        (tmp_path / name).write_bytes(content)
    if setup == "exists":
        (tmp_path / "out.bin").write_bytes(b"precious")
    before = _outputs(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_prepare([*args, "--output-prefix", str(tmp_path / "out"), "--train-tokenizer", "--vocab-size", "300",
                        "--no-progress"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("grt-prepare-data: error:") and needle.replace("{tmp}", str(tmp_path)) in lines[-1]
    assert "Traceback" not in proc.stderr
    assert _outputs(tmp_path) == before  # nothing half-written, temporary files included
    if setup == "exists":
        assert (tmp_path / "out.bin").read_bytes() == b"precious"


def test_skip_and_replace_policies_count(tmp_path, pydoc_prefix):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "good one"}\nnot json\n{"text": "caf\xe9"}\n{"other": 1}\n{"text": "good two"}\n')
    prefix = tmp_path / "out"
    proc = run_prepare(["--input", str(path), "--output-prefix", str(prefix), "--on-bad-record", "skip",
                        "--on-decode-error", "replace", "--tokenizer", str(prefix_paths(pydoc_prefix[0])["tokenizer"]),
                        "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "2 bad records skipped" in proc.stdout and "1 records with non-UTF-8 bytes replaced" in proc.stdout
    meta = json.loads(prefix_paths(prefix)["meta"].read_text())
    assert (meta["documents"], meta["skipped_records"], meta["replaced_decode_errors"]) == (3, 2, 1)


def test_tokenizer_options_that_were_ignored_or_a_traceback_are_one_line(tmp_path, pydoc_prefix):
    tokenizer = str(prefix_paths(pydoc_prefix[0])["tokenizer"])
    (tmp_path / "empty.model").write_bytes(b"")
    for args, needle in ((["--tokenizer", tokenizer, "--vocab-size", "77"],
                          "--vocab-size 77 applies to --train-tokenizer"),  # was ignored in silence
                         (["--tokenizer", str(tmp_path / "empty.model")],
                          "empty.model: not a sentencepiece model (no pieces"),  # was a traceback
                         ):
        proc = run_prepare(["--input", str(SHAKESPEARE), "--output-prefix", str(tmp_path / "out"), *args,
                            "--no-progress"])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines[-1].startswith("grt-prepare-data: error:") and needle in lines[-1]
        assert "Traceback" not in proc.stderr and not list(tmp_path.glob("out*"))


def test_truncated_bin_and_mismatched_idx_are_refused(tmp_path, pydoc_prefix):
    import shutil

    src = pydoc_prefix[0]
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(str(src) + suffix, str(tmp_path / "t") + suffix)
    verify_prefix(tmp_path / "t")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match=r"t\.bin has 1000 bytes but .*t\.idx describes \d+: the \.bin is truncated"):
        verify_prefix(tmp_path / "t")
    # An .idx from another dataset beside this .bin.
    shutil.copy(str(src) + ".bin", tmp_path / "t.bin")
    other = tmp_path / "other"
    (tmp_path / "in.txt").write_text("a short other corpus")
    proc = run_prepare(["--input", str(tmp_path / "in.txt"), "--output-prefix", str(other), "--tokenizer",
                        str(prefix_paths(src)["tokenizer"]), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    shutil.copy(str(other) + ".idx", tmp_path / "t.idx")
    with pytest.raises(DataError, match="does not match"):
        verify_prefix(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"t\.idx: not a valid Megatron index"):
        verify_prefix(tmp_path / "t")


def test_a_prefix_without_manifest_is_checked_by_the_tokenizer_beside_it(tmp_path, pydoc_prefix, capsys):
    """Without .meta.json the configured tokenizer went unchecked: a run trained on ids of another one."""
    import shutil

    src = pydoc_prefix[0]
    for suffix in (".bin", ".idx"):
        shutil.copy(str(src) + suffix, str(tmp_path / "t") + suffix)
    right = load_tokenizer(prefix_paths(src)["tokenizer"]).identity
    verify_prefix(tmp_path / "t", right)  # nothing shows the tokenizer: said, not refused (another tool's prefix)
    assert "has no .meta.json nor .tokenizer.model: nothing shows which tokenizer made it" in capsys.readouterr().out
    shutil.copy(prefix_paths(src)["tokenizer"], str(tmp_path / "t") + ".tokenizer.model")
    assert verify_prefix(tmp_path / "t", right) is None
    with pytest.raises(DataError, match=r"was tokenized with .*t\.tokenizer\.model, not the tokenizer configured"):
        verify_prefix(tmp_path / "t", "0" * 64)


def test_kill_during_preprocessing_leaves_nothing_training_accepts(tmp_path, pydoc_prefix):
    books = SHARED_DATA / "books.jsonl"
    prefix = tmp_path / "killed"
    cmd = [sys.executable, "-m", "grt_megatron.data.prepare", "--output-prefix", str(prefix), "--tokenizer",
           str(prefix_paths(pydoc_prefix[0])["tokenizer"]), "--no-progress", *(["--input", str(books)] * 6)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("killed.tmp-*.bin")):
        time.sleep(0.05)
    assert list(tmp_path.glob("killed.tmp-*.bin")), "preprocessing never started writing"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not prefix_paths(prefix)["idx"].exists() and not prefix_paths(prefix)["bin"].exists()
    with pytest.raises(DataError, match=r"killed\.idx not found"):
        verify_prefix(prefix)
