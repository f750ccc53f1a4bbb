"""grt-prepare-data under faults: interrupted at every stage (exit 128 + signal, one line, nothing left under
the prefix), temporaries of killed runs removed by the next, directory inputs, directory prefixes, and
--overwrite leaving exactly the new run's files."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, SHAKESPEARE, SHARED_DATA, run_prepare, stdout_lines, wait_for_line
from grt_megatron.data import DataError, SentencePieceTokenizer, load_tokenizer
from grt_megatron.data.indexed import prefix_paths, signals_deferred, temp_prefix, verify_prefix
from grt_megatron.data.sources import iter_documents

# Tokenizer training on this takes a second or two: long enough to be interrupted in the middle.
BIG_INPUT = ["--input", str(SHAKESPEARE)] * 20


def _start(args: list[str]) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    """`grt-prepare-data ARGS` in its own process group (as a terminal's foreground job), its stdout lines
    arriving in a queue."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    proc = subprocess.Popen([sys.executable, "-m", "grt_megatron.data.prepare", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, stdout_lines(proc)


def _interrupt(proc: subprocess.Popen, sig: int) -> None:
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what Ctrl-C does: the whole foreground group, workers included
    else:
        os.kill(proc.pid, sig)  # what `kill PID` or a scheduler does


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def given_tokenizer(pydoc_prefix):
    return str(prefix_paths(pydoc_prefix[0])["tokenizer"])


# ---- 1. interruptions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sig,delay", [(signal.SIGINT, 0.2), (signal.SIGTERM, 0.2), (signal.SIGINT, 1.0)],
                         ids=["sigint-reading", "sigterm-reading", "sigint-later"])
def test_interrupted_tokenizer_training_exits_with_the_signal_and_leaves_nothing(tmp_path, sig, delay):
    prefix = tmp_path / "p"
    proc, lines = _start([*BIG_INPUT, "--output-prefix", str(prefix), "--train-tokenizer", "--vocab-size", "1000",
                          "--no-progress"])
    wait_for_line(lines, "training a bpe tokenizer", "grt-prepare-data")
    time.sleep(delay)  # 0.2 s: sentencepiece still reads sentences; 1 s: mostly in its own training
    _interrupt(proc, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    name = signal.Signals(sig).name
    # A late signal may find training just finished: then it is reported during tokenization.
    stages = ("tokenizer training",) if delay < 1 else ("tokenizer training", "tokenization")
    assert _one_line(stderr) in [f"grt-prepare-data: interrupted ({name}) during {stage}; nothing written under "
                                 f"{prefix}" for stage in stages]
    assert _names(tmp_path) == []  # no prefix file, no temporary


def test_interruption_inside_the_sentence_iterator_is_not_swallowed():
    class Stop(BaseException):
        pass

    def documents(exc):
        yield from iter_documents(str(SHAKESPEARE))
        raise exc

    for exc in (KeyboardInterrupt(), Stop()):  # what SIGINT / a SIGTERM handler raise
        start = time.perf_counter()
        with pytest.raises(type(exc)):
            SentencePieceTokenizer.train(documents(exc), vocab_size=400)
        assert time.perf_counter() - start < 30  # stopped, not trained on the sample read so far


@pytest.mark.parametrize("sig,workers,delay", [
    (signal.SIGINT, 2, 0.0),  # as the workers start: multiprocessing.Pool hung here in terminate()
    (signal.SIGINT, 2, 0.5),  # multiprocessing.Pool's start-up lost it (exit 0) 1 run in 3
    (signal.SIGTERM, 1, 0.5)], ids=["sigint-2-workers-at-start", "sigint-2-workers", "sigterm-1-worker"])
def test_interrupted_tokenization_exits_with_the_signal_and_leaves_nothing(tmp_path, given_tokenizer, sig, workers,
                                                                          delay):
    prefix = tmp_path / "p"
    proc, _ = _start([*BIG_INPUT, "--output-prefix", str(prefix), "--tokenizer", given_tokenizer,
                      "--workers", str(workers), "--no-progress"])
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("p.tmp-*.bin")) and proc.poll() is None:
        time.sleep(0.01)
    assert list(tmp_path.glob("p.tmp-*.bin")), "tokenization never started writing"
    time.sleep(delay)
    _interrupt(proc, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert _one_line(stderr) == (f"grt-prepare-data: interrupted ({signal.Signals(sig).name}) during tokenization; "
                                 f"nothing written under {prefix}")
    assert _names(tmp_path) == []


def test_a_killed_tokenizer_worker_fails_the_run_in_one_line_and_leaves_nothing(tmp_path, given_tokenizer):
    prefix = tmp_path / "p"
    proc, _ = _start([*BIG_INPUT, "--output-prefix", str(prefix), "--tokenizer", given_tokenizer,
                      "--workers", "2", "--no-progress"])
    deadline = time.time() + 120
    workers: list[str] = []
    while time.time() < deadline and len(workers) < 2 and proc.poll() is None:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        time.sleep(0.01)
    assert len(workers) == 2, "the workers never started"
    os.kill(int(workers[1]), signal.SIGKILL)  # what the OOM killer does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert _one_line(stderr).startswith(f"grt-prepare-data: error: tokenizer worker 1 (pid {workers[1]}) was killed "
                                        f"by SIGKILL (out of memory?); nothing written under {prefix}")
    assert _names(tmp_path) == []


def test_a_signal_during_the_commit_waits_for_its_end():
    done = False
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python would run the handler here
            done = True
    assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---- 2. temporaries of killed runs ----------------------------------------------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


def test_stale_temporaries_of_dead_runs_are_removed_and_others_kept(tmp_path, given_tokenizer):
    dead, host = _dead_pid(), socket.gethostname()
    stale = [f"{temp_prefix(tmp_path / 'p', host, dead)}{suffix}" for suffix in
             (".bin", ".idx", ".tokenizer.model.tmp")]
    kept = [temp_prefix(tmp_path / "p", host, os.getpid()) + ".bin",  # a live run (this test)
            temp_prefix(tmp_path / "p", "another-host.example", dead) + ".bin",  # cannot tell from here
            temp_prefix(tmp_path / "q", host, dead) + ".bin"]  # another prefix
    for path in stale + kept:
        open(path, "wb").write(b"x")
    (tmp_path / "in.txt").write_text("a small corpus")
    proc = run_prepare(["--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "p"), "--tokenizer",
                        given_tokenizer, "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert f"removed 3 temporary files of dead earlier runs on this host: p.tmp-{host}-{dead}.bin" in proc.stdout
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.exists(p) for p in kept)
    verify_prefix(tmp_path / "p")


def test_kill_9_leftovers_are_removed_by_the_next_run(tmp_path, given_tokenizer):
    prefix = tmp_path / "p"
    proc, _ = _start(["--output-prefix", str(prefix), "--tokenizer", given_tokenizer, "--no-progress",
                      *(["--input", str(SHARED_DATA / "books.jsonl")] * 6)])
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("p.tmp-*.bin")):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _names(tmp_path)
    assert left and all(name.startswith(f"p.tmp-{socket.gethostname()}-{proc.pid}.") for name in left)
    (tmp_path / "in.txt").write_text("a small corpus")
    again = run_prepare(["--input", str(tmp_path / "in.txt"), "--output-prefix", str(prefix), "--tokenizer",
                         given_tokenizer, "--no-progress"])
    assert again.returncode == 0, again.stderr
    assert "temporary files of dead earlier runs" in again.stdout and left[0] in again.stdout
    assert _names(tmp_path) == ["in.txt", "p.bin", "p.idx", "p.meta.json"]


# ---- 3. directory inputs --------------------------------------------------------------------------------

def _corpus_dir(root):
    """A folder of every supported kind, nested, plus files that are not read; returns the documents in
    the order a directory source gives them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "a" / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("text of b")
    (root / "a" / "2.jsonl").write_text(json.dumps({"text": "jsonl one"}) + "\n" + json.dumps({"text": "jsonl two"}))
    (root / "a" / "1.txt").write_text("text of a/1")
    (root / "a" / "sub" / "z.json").write_text(json.dumps({"text": "json z"}))
    pq.write_table(pa.table({"text": ["parquet row"]}), root / "c.parquet")
    (root / "notes.md").write_text("not read")
    (root / "a" / "data.csv").write_text("not,read")
    # a/ before b.txt (folder by folder), a/1.txt, a/2.jsonl, then a/sub/.
    return ["text of a/1", "jsonl one", "jsonl two", "json z", "text of b", "parquet row"]


def test_directory_source_reads_its_files_in_sorted_order(tmp_path, monkeypatch, given_tokenizer):
    from grt_megatron.data.prepare import prepare_dataset

    expected = _corpus_dir(tmp_path / "corpus")
    assert list(iter_documents(str(tmp_path / "corpus"))) == expected
    monkeypatch.chdir(tmp_path)  # a bare relative name is the folder, not a Hugging Face dataset
    assert list(iter_documents("corpus")) == expected
    # What grt-train's data=DIR (data.source=DIR) runs.
    summary = prepare_dataset(["corpus"], tmp_path / "out" / "p", load_tokenizer(given_tokenizer), progress=False)
    assert summary.documents == len(expected)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.md").write_text("not read")
    with pytest.raises(DataError, match=r"input 'empty': a directory without any \*\.txt, \*\.jsonl, \*\.json, "
                                        r"\*\.parquet file \(searched recursively\)"):
        list(iter_documents("empty"))


def test_cli_directory_input(tmp_path, given_tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    expected = _corpus_dir(tmp_path / "corpus")
    proc = run_prepare(["--input", str(tmp_path / "corpus"), "--output-prefix", str(tmp_path / "p"), "--tokenizer",
                        given_tokenizer, "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    tok, ds = load_tokenizer(given_tokenizer), IndexedDataset(str(tmp_path / "p"))
    assert [tok.decode(ds[i][:-1]) for i in range(len(ds))] == expected

    (tmp_path / "empty").mkdir()
    before = _names(tmp_path)
    proc = run_prepare(["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "q"), "--tokenizer",
                        given_tokenizer, "--no-progress"])
    assert proc.returncode == 2
    assert _one_line(proc.stderr) == (f"grt-prepare-data: error: input '{tmp_path / 'empty'}': a directory without "
                                      "any *.txt, *.jsonl, *.json, *.parquet file (searched recursively)")
    assert _names(tmp_path) == before


# ---- 4. a prefix that is a directory --------------------------------------------------------------------

@pytest.mark.parametrize("prefix,existing", [("out/", False), ("out/", True), ("out", True)])
def test_output_prefix_naming_a_directory_is_refused(tmp_path, prefix, existing):
    (tmp_path / "in.txt").write_text("a small corpus")
    if existing:
        (tmp_path / "out").mkdir()
    before = _names(tmp_path)
    target = str(tmp_path) + os.sep + prefix
    proc = run_prepare(["--input", str(tmp_path / "in.txt"), "--output-prefix", target, "--train-tokenizer",
                        "--vocab-size", "300", "--no-progress"])
    assert proc.returncode == 2
    assert _one_line(proc.stderr) == (f"grt-prepare-data: error: output prefix {target!r} names a directory; give a "
                                      f"file-name prefix, e.g. {str(tmp_path / 'out' / 'corpus')!r}")
    assert _names(tmp_path) == before and (not existing or _names(tmp_path / "out") == [])


# ---- 5. --overwrite -------------------------------------------------------------------------------------

def test_overwrite_leaves_exactly_the_new_runs_files(tmp_path, given_tokenizer):
    (tmp_path / "in.txt").write_text(SHAKESPEARE.read_text()[:40_000])
    prefix = tmp_path / "out" / "p"
    paths = prefix_paths(prefix)

    def run(*args, source=tmp_path / "in.txt"):
        return run_prepare(["--input", str(source), "--output-prefix", str(prefix), "--overwrite", "--no-progress",
                            *args])

    def prepare(*args, **kwargs):
        proc = run(*args, **kwargs)
        assert proc.returncode == 0, proc.stderr
        return json.loads(paths["meta"].read_text())

    meta = prepare("--train-tokenizer", "--vocab-size", "400")
    first = load_tokenizer(paths["tokenizer"])
    assert meta["tokenizer"]["sha256"] == first.identity and meta["tokenizer_file"] == "p.tokenizer.model"

    # Another, shorter corpus with a given tokenizer: its tokens replace the first's, and having no tokenizer of
    # its own, the stale one goes.
    (tmp_path / "short.txt").write_text("second, shorter version of the text")
    meta = prepare("--tokenizer", given_tokenizer, source=tmp_path / "short.txt")
    assert _names(prefix.parent) == ["p.bin", "p.idx", "p.meta.json"]
    assert meta["tokenizer"]["sha256"] == load_tokenizer(given_tokenizer).identity and "tokenizer_file" not in meta
    verify_prefix(prefix, load_tokenizer(given_tokenizer).identity)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))  # kept alive while its items (views of its memory map) are read
    assert len(dataset) == 1
    assert load_tokenizer(given_tokenizer).decode(dataset[0][:-1]) == "second, shorter version of the text"
    del dataset

    meta = prepare("--train-tokenizer", "--vocab-size", "500")
    assert _names(prefix.parent) == ["p.bin", "p.idx", "p.meta.json", "p.tokenizer.model"]
    second = load_tokenizer(paths["tokenizer"])
    assert second.vocab_size == 500 and second.identity != first.identity
    assert meta["tokenizer"]["sha256"] == second.identity
    verify_prefix(prefix, second.identity)

    # A failing --overwrite run touches nothing of the complete prefix.
    before = {p: p.read_bytes() for p in prefix.parent.iterdir()}
    (tmp_path / "in.txt").write_text("\n\n")
    proc = run("--train-tokenizer", "--vocab-size", "400")
    assert proc.returncode == 2 and "the corpus is empty" in _one_line(proc.stderr)
    assert {p: p.read_bytes() for p in prefix.parent.iterdir()} == before
