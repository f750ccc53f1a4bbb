"""The tokenizer worker processes of `grt-prepare-data --workers N`: results in input order equal one
process's, a worker's error or death stops the run with one line (a scheduler's signal as that signal), and
no worker outlives its parent or the run."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, SHAKESPEARE
from grt_megatron.data import load_documents, load_tokenizer
from grt_megatron.data.indexed import prefix_paths
from grt_megatron.data.tokenizer_workers import TokenizerWorkerError, TokenizerWorkers
from grt_megatron.errors import Interrupted


@pytest.fixture(scope="module")
def tokenizer(pydoc_prefix):
    return load_tokenizer(prefix_paths(pydoc_prefix[0])["tokenizer"])


@pytest.fixture(scope="module")
def chunks():
    docs = load_documents(str(SHAKESPEARE))[:300]
    return [docs[i:i + 7] for i in range(0, len(docs), 7)]  # 43 chunks: more than in flight, uneven tail


def _alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie counts as gone: only its parent can reap it. (One read of /proc: a check
    of the pid first and a read after could find it reaped in between.)"""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("workers", [1, 3])
def test_results_equal_one_process_in_input_order(tokenizer, chunks, workers):
    with TokenizerWorkers(tokenizer, workers) as pool:
        pids = pool.pids
        assert len(pids) == workers
        # Own process groups: a terminal's Ctrl-C (to the foreground group) reaches only the parent.
        assert all(os.getpgid(pid) == pid != os.getpgid(0) for pid in pids)
        results = list(pool.imap(iter(chunks)))
    assert results == [tokenizer.encode_batch(chunk) for chunk in chunks]
    assert not any(_alive(pid) for pid in pids)  # a normal end waits for the workers to exit


def test_a_tokenizer_error_in_a_worker_is_raised_with_its_message(tokenizer, chunks):
    with pytest.raises(TokenizerWorkerError, match=r"tokenizer worker 1: TypeError"):
        with TokenizerWorkers(tokenizer, 2) as pool:
            pids = pool.pids
            list(pool.imap([chunks[0], [None], chunks[1]]))  # sentencepiece cannot encode None
    assert not any(_alive(pid) for pid in pids)  # leaving on an exception kills the others


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_dead_worker_stops_the_run(tokenizer, chunks, sig):
    """SIGKILL (the OOM killer) is a failure naming the worker; SIGTERM (a scheduler signalling every process of
    the job, the parent's own handler maybe not yet run) is the run being stopped by SIGTERM."""
    expected = (pytest.raises(TokenizerWorkerError, match=r"tokenizer worker 0 \(pid \d+\) was killed by SIGKILL "
                                                          r"\(out of memory\?\)")
                if sig == signal.SIGKILL else pytest.raises(Interrupted))
    with expected as caught:
        with TokenizerWorkers(tokenizer, 2) as pool:
            pids = pool.pids
            results = pool.imap(chunks)
            next(results)
            os.kill(pids[0], sig)
            list(results)
    if sig == signal.SIGTERM:
        assert caught.value.signum == signal.SIGTERM and caught.value.where == "tokenization"
    assert not any(_alive(pid) for pid in pids)


def test_workers_exit_when_their_parent_is_killed(tmp_path, pydoc_prefix):
    script = textwrap.dedent(f"""
        import os, signal
        from grt_megatron.data import load_tokenizer
        from grt_megatron.data.tokenizer_workers import TokenizerWorkers
        pool = TokenizerWorkers(load_tokenizer({str(prefix_paths(pydoc_prefix[0])["tokenizer"])!r}), 2)
        print(*pool.pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(pid) for pid in proc.stdout.split()]
    assert len(pids) == 2
    assert _gone_within(pids, 30), "a worker outlived its killed parent"
