"""Claiming a run directory: one writer at a time, and nothing written before the run is accepted.

    RUN_DIR/.grt-train.lock     an exclusive OS lock (flock) held by global rank 0 while grt-train runs;
                                its text names the holder (pid, host, start time, command line)
    RUN_DIR/.hydra/config.yaml  the composed config and the command-line overrides, written once the run
    RUN_DIR/.hydra/overrides.yaml   is accepted (hydra's own writer is off: it wrote before any check)

The lock dies with its process (a killed run never leaves a stale lock). Only rank 0 takes it, so that on
a filesystem shared by many nodes one job is one holder. flock works across nodes on NFSv4 and on Lustre
mounted with `-o flock`; on a filesystem without it taking the lock fails and the run is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from grt_megatron.files import file_in_the_way, write_atomic
from grt_megatron.model import ConfigError

LOCK_FILE = ".grt-train.lock"


def _holder_text(path: Path, wait_s: float = 2.0) -> str:
    """Who holds the lock, as the holder's text names it. The holder writes that text just after it takes
    the lock, so a run refused in that instant reads an empty file, or the text a finished run left there
    (two runs started at once, under load, were refused naming no pid): it reads again for up to `wait_s`
    until the text names a live process (on this host; another host's cannot be checked)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = json.loads(path.read_text())
            if holder["host"] != socket.gethostname() or _alive(int(holder["pid"])):
                return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() >= deadline:
            return "a process that has just started"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


class RunLock:
    """An exclusive, non-blocking flock on `RUN_DIR/.grt-train.lock` for the life of this process."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"run.dir={str(self.run_dir)!r} is not writable ({os.strerror(err.errno)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"run.dir={str(self.run_dir)!r} is in use by another grt-train "
                                  f"({_holder_text(self.path)}): wait for it to end, or choose another run.dir"
                                  ) from None
            raise ConfigError(f"run.dir={str(self.run_dir)!r}: cannot lock {self.path.name} "
                              f"({os.strerror(err.errno)}; the filesystem must support flock)") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    created_dir = False
    """Whether `claim_run_dir` created `run_dir` (a refused run then takes it away again)."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def release_refused(self) -> None:
        """Release after a refusal: a directory this run created and left holding only the lock file is
        removed, so that a refused run leaves nothing behind."""
        self.release()
        if self.created_dir:
            try:
                if [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                    self.path.unlink()
                    self.run_dir.rmdir()
            except OSError:
                pass  # another process may have started in it meanwhile: leave it


def check_folder_setting(setting: str, folder: Path) -> None:
    """A folder setting (`checkpoint.dir`, `data.cache_dir`) must be, or be creatable as, a folder: found out
    later, a file on its path would end the run with a traceback (the cache) or at its first save, after
    training up to it (the checkpoints)."""
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise ConfigError(f"{setting}={str(folder)!r}: {blocking} is a file, not a folder")


def claim_run_dir(run_dir: Path, resume: Optional[str]) -> RunLock:
    """Rank 0, before anything else touches `run_dir`: create it, lock it and refuse a second run in it.
    Raises ConfigError (one line) and writes nothing on refusal (the lock file aside, which holds no run's
    data). The run's config is recorded later (`record_run`), once every check has passed."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.dir={str(run_dir)!r} cannot be created ({os.strerror(err.errno)})") from None
    lock = RunLock(run_dir)
    lock.created_dir = created
    lock.acquire()
    try:
        if (run_dir / "metrics.jsonl").exists() and resume is None:
            raise ConfigError(f"run.dir={str(run_dir)!r} already holds a run (metrics.jsonl): pass resume=auto "
                              "to continue it, or choose a new run.dir")
    except BaseException:
        lock.release_refused()
        raise
    return lock


def record_run(run_dir: Path, config_yaml: Optional[str], overrides: Optional[list[str]]) -> None:
    """Rank 0, once the run is accepted (every config, data and resume check passed): `.hydra/`'s record
    of the composed config and the command-line overrides. A refused run, a resume refused included, leaves
    an existing record as it was."""
    try:
        if config_yaml is not None:
            write_atomic(Path(run_dir) / ".hydra" / "config.yaml", config_yaml)
        if overrides is not None:
            write_atomic(Path(run_dir) / ".hydra" / "overrides.yaml",
                          "".join(f"- {json.dumps(o)}\n" for o in overrides))
    except OSError as err:
        raise ConfigError(f"run.dir={str(run_dir)!r} is not writable ({os.strerror(err.errno)})") from None
