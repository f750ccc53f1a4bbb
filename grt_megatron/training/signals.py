"""How `grt-train` reacts to signals, from its first line to its last.

- During set-up (imports, data preparation, model build, loading a checkpoint) and after the loop:
  SIGINT, SIGTERM and SIGUSR1 raise `Interrupted` at once. It unwinds through every `finally` (temporary
  files removed, the run lock released) and the CLI exits 128 + the signal's number with one line.
  Checkpoints are written atomically, so nothing a later `resume=auto` reads is half-written.
- In the training loop: SIGTERM and SIGUSR1 (SLURM's warning before the time limit, preemption) and a
  first SIGINT (Ctrl-C) ask to stop: the step finishes, a checkpoint is saved, every rank stops at the
  same step (with several processes the step after, see trainer.py's `StopAgreement`). SIGTERM/SIGUSR1
  then exit 0 so that the scheduler can requeue the job; SIGINT exits 130. A second SIGINT raises
  `Interrupted` at once.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator, Optional

from grt_megatron.errors import Interrupted, raise_interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def raise_on_signals() -> None:
    """Install the set-up behaviour (raise at once). Only the main thread can install handlers."""
    for sig in HANDLED:
        signal.signal(sig, raise_interrupted)


class StopRequests:
    """The loop's behaviour: remember the signal; the trainer stops after the current step."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def _remember(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise Interrupted(signum, "the training loop (second SIGINT)")
        self.signum = signum

    @contextmanager
    def installed(self) -> Iterator["StopRequests"]:
        previous = {sig: signal.signal(sig, self._remember) for sig in HANDLED}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def exit_code_after_stop(signal_name: Optional[str]) -> int:
    """Exit status of a run that stopped (and saved) after a request: 130 for Ctrl-C, else 0 (SIGTERM,
    SIGUSR1 and train.exit_interval mean "requeue me")."""
    return 130 if signal_name == "SIGINT" else 0
