"""Tokenizer worker processes for `grt-prepare-data --workers N`: chunks of documents in, token ids out, in
input order, so the prefix written is the same for any N.

Why not `multiprocessing.Pool`: (1) its task-feeding thread can be caught blocked on a full pipe when the
pool is terminated, and `Pool.terminate()` then waits for it forever (a Ctrl-C at the start of tokenization
hung grt-prepare-data); (2) its workers share the terminal's process group, so a Ctrl-C reaches them too,
and keeping them from answering it meant ignoring SIGINT in the parent while they started, which dropped a
Ctrl-C that came in those moments (the command went on and exited 0; a blocked signal mask is no way out:
the exec in `subprocess` clears it).

Here each worker is its own process group (`process_group=0`): a terminal's Ctrl-C goes to the foreground
group, so it reaches only the parent, which kills the workers. (A new session would do the same, but on
kernels with autogroup scheduling a session is also a scheduling group: on a busy machine the workers then
ran 2x slower than one process.) The calling thread feeds each worker over its own socket, and a thread in
each worker takes chunks as they come, so no send waits on the other side's. A worker whose parent goes
away reads EOF and exits."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Iterable, Iterator, NoReturn, Sequence, Union

from grt_megatron.data.tokenizer import Tokenizer
from grt_megatron.errors import Interrupted

# A worker killed by one of these was stopped by whoever stops the run (a scheduler signalling every process
# of the job, `kill` of the group): the run reports the signal, not a failed worker.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Two: one being encoded, the next waiting, so a worker never idles while the parent writes.
CHUNKS_IN_FLIGHT = 2


class TokenizerWorkerError(RuntimeError):
    """A tokenizer worker failed (its tokenizer raised) or died (killed, out of memory)."""


def _serve(conn: Connection) -> None:
    """A worker's loop: receive the tokenizer, then encode each chunk received until the parent sends None or
    goes away. A reader thread keeps taking chunks while this one encodes and sends, so the parent's sends
    never wait on ours (both sides writing to full sockets would deadlock). The pickles come from the parent
    process over a private socket, as in multiprocessing."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(item := conn.recv())
                if item is None:
                    return
        except (EOFError, OSError):
            inbox.put(None)  # the parent closed its end or died

    try:
        tokenizer: Tokenizer = conn.recv()
    except (EOFError, OSError):
        return
    threading.Thread(target=read, name="chunk-reader", daemon=True).start()
    while (texts := inbox.get()) is not None:
        try:
            reply = ("ok", tokenizer.encode_batch(texts))
        except Exception as err:  # reported by the parent, which stops the run
            reply = ("error", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except OSError:
            return


def _exit_description(returncode: int | None) -> str:
    if returncode is None:
        return "closed its pipe"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"was killed by {name}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    return f"exited with code {returncode}"


class TokenizerWorkers:
    """`workers` processes, each holding its own copy of `tokenizer`. Use as a context manager: leaving
    normally lets the workers finish; leaving on an exception (a signal's among them) kills them."""

    def __init__(self, tokenizer: Tokenizer, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        try:
            for _ in range(workers):
                ours, theirs = socket.socketpair()
                with theirs:
                    self._conns.append(Connection(ours.detach()))
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                        process_group=0, stdin=subprocess.DEVNULL))
            for worker in range(workers):
                # Through `_send`: a worker killed before it took its tokenizer (the test's SIGKILL can land
                # that early) fails as any dead worker does, in one line, not as a bare BrokenPipeError.
                self._send(worker, tokenizer)
        except BaseException:
            self._stop(kill=True)
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def __enter__(self) -> "TokenizerWorkers":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop(kill=exc_type is not None)

    def imap(self, chunks: Iterable[Sequence[str]]) -> Iterator[list[list[int]]]:
        """Encode each chunk, yielding the results in the order of `chunks`. Chunks go round-robin, at most
        CHUNKS_IN_FLIGHT per worker, so that each has its next chunk waiting when it sends a result."""
        chunks = iter(chunks)
        workers = len(self._procs)
        in_flight: deque[int] = deque()  # the worker of each chunk sent, in the order sent
        sent = 0
        while True:
            while len(in_flight) < CHUNKS_IN_FLIGHT * workers and (chunk := next(chunks, None)) is not None:
                worker = sent % workers
                self._send(worker, list(chunk))
                in_flight.append(worker)
                sent += 1
            if not in_flight:
                return
            yield self._receive(in_flight.popleft())

    def _send(self, worker: int, message: Union[Tokenizer, list[str]]) -> None:
        """Send a worker its tokenizer or a chunk; a dead worker raises `TokenizerWorkerError` in one line."""
        try:
            self._conns[worker].send(message)
        except (BrokenPipeError, ConnectionResetError):
            self._raise_died(worker)

    def _receive(self, worker: int) -> list[list[int]]:
        try:
            status, payload = self._conns[worker].recv()
        except (EOFError, ConnectionResetError):
            self._raise_died(worker)
        if status == "error":
            raise TokenizerWorkerError(f"tokenizer worker {worker}: {payload}")
        return payload

    def _raise_died(self, worker: int) -> NoReturn:
        proc = self._procs[worker]
        try:
            returncode = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            returncode = None
        if returncode is not None and -returncode in STOP_SIGNALS:
            raise Interrupted(-returncode, "tokenization")
        raise TokenizerWorkerError(f"tokenizer worker {worker} (pid {proc.pid}) {_exit_description(returncode)}")

    def _stop(self, kill: bool) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if kill:
                if proc.poll() is None:
                    proc.kill()
            else:
                try:
                    conn.send(None)
                except OSError:
                    pass  # already gone: its exit code is all there is to collect
        for proc in self._procs:
            try:
                proc.wait(timeout=None if kill else 30)
            except subprocess.TimeoutExpired:  # a worker that did not finish 30 s after its last chunk
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
    os._exit(0)  # skip interpreter teardown: nothing is left to flush, and exiting at once is what the parent waits on
