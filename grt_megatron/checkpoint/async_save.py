"""`AsyncSaver`: checkpoints written by a background thread while training goes on
(`checkpoint.async_save=true`).

The training loop takes a snapshot at the step (`snapshot_checkpoint`: the rank's part of the weights and
moments copied to pinned host memory, the RNG and trainer state as bytes), hands it over and continues.
The writer thread writes the files, then runs the commit's collectives on a gloo group of its own, so
they never interleave with training's collectives on the world's group. One save at a time: a new one (and
the end of training, and a signal-triggered save) first waits for the one in flight, and a failed save
raises its `CheckpointWriteError` there, on every rank. A process killed while the writer runs leaves a
`.tmp-step_N` directory that is never read: the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from grt_megatron.checkpoint.checkpointer import SaveSnapshot, write_snapshot


class AsyncSaver:
    def __init__(self):
        # Collective: every rank creates the group, at the same point of its start-up.
        self.group = dist.new_group(backend="gloo")
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    @property
    def in_flight(self) -> bool:
        return self.thread is not None

    def submit(self, snapshot: SaveSnapshot, on_done: Callable[[Path, float], None]) -> None:
        """Write `snapshot` in the background; `on_done(path, seconds)` runs in the writer when committed."""
        self.wait()

        def write():
            start = time.perf_counter()
            try:
                path = write_snapshot(snapshot, self.group)
            except BaseException as err:  # noqa: BLE001 — raised in the training thread by `wait`
                self.error = err
                return
            on_done(path, time.perf_counter() - start)

        # A daemon: a run that fails elsewhere exits without it (its .tmp directory is never read).
        self.thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Until the save in flight (if any) is committed; its failure is raised here."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread, error, self.error = None, self.error, None
        if error is not None:
            raise error
