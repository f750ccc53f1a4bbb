"""Counting where a training step makes the host wait for the device, on any device, CPU included.

On a GPU the host queues kernels ahead of the device; reading a value back (`.item()`, `float(t)`, a
comparison in an `if`) makes it wait until everything queued so far has run, and the device then idles
while the host launches the next kernels. Such waits are invisible on a CPU, where every op runs when it
is called, so a CPU test cannot time them. It can count them: every host read of a tensor's value goes
through `aten::_local_scalar_dense`, and a read is a wait when device work was queued since the last one
(a second read straight after the first finds the queue already empty). The GPU check's profile gives
the same reads as `aten::item` in `host_waits`.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def host_resident_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors that stay on the host on every device: torch's non-fused Adam keeps each parameter's step
    counter on the CPU and reads it there for the bias corrections (fused, it moves them to the device)."""
    return [s["step"] for s in optimizer.state.values() if torch.is_tensor(s.get("step"))
            and s["step"].device.type == "cpu"]


class HostWaitCounter(TorchDispatchMode):
    """`with HostWaitCounter(host_resident) as counter:` ... `counter.waits`, `counter.reads`: the host
    reads of tensor values in the block (except of `host_resident` tensors, which live on the host on a
    GPU too), and those of them that had device work queued before them."""

    def __init__(self, host_resident=()):
        super().__init__()
        self.reads = 0
        self.waits = 0
        self._work_since_read = False
        self._host_resident = {t.data_ptr() for t in host_resident}

    def __enter__(self):
        # `Tensor.tolist` reads the values without going through the dispatcher (no `_local_scalar_dense`), so
        # the mode alone would not see it; it waits for the device as `.item()` does. The patch is on the class,
        # so it counts only this thread's reads, as the mode does (torch's dispatch-mode stack is per thread):
        # a data-loading thread's tolist is not the step's.
        self._own_tolist = torch.Tensor.__dict__.get("tolist")  # None: inherited from torch._C.TensorBase
        counter, tolist, thread = self, torch.Tensor.tolist, threading.get_ident()

        def counted_tolist(tensor):
            if threading.get_ident() == thread and tensor.data_ptr() not in counter._host_resident:
                counter.reads += 1
                counter.waits += counter._work_since_read
                counter._work_since_read = False
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._own_tolist is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = self._own_tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].data_ptr() in self._host_resident:
                return out
            self.reads += 1
            self.waits += self._work_since_read
            self._work_since_read = False
        elif not func.is_view:  # views launch nothing
            self._work_since_read = True
        return out
