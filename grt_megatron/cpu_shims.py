"""Every patch grt-megatron applies to megatron-core and DeepSpeed so that they run without CUDA.

megatron-core 0.16 calls CUDA in places that have nothing to do with the math (scratch buffers, the RNG
tracker), and DeepSpeed compiles a shared-memory C++ op at every CPU process-group start (~20 s). The
math itself runs unchanged on CPU with gloo. Each shim below is small, named, applied at most once, and
only when CUDA is absent; `apply_cpu_shims()` returns the names of those it applied so that tests can
check each one. Nothing else in the project patches third-party code.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

_APPLIED: list[str] = []


def _cuda_current_device_is_cpu() -> None:
    """megatron-core allocates with `device=torch.cuda.current_device()` in ~40 places that have nothing
    to do with CUDA: the attention scratch buffer (GlobalMemoryBuffer), the all-gather / reduce-scatter
    outputs of tensor and sequence parallelism, RoPE's frequencies. Without CUDA that call raises; here it
    names the CPU, so each of those allocations lands where the model is. Code that needs a real GPU index
    fails as it would have anyway."""
    torch.cuda.current_device = lambda: torch.device("cpu")


class _SilenceExpectedCpuRngWarning(logging.Filter):
    """On CPU the tracker's states *are* CPU generator states, so the tracker's warning that the CPU
    RNG changed inside a fork is expected on every fork; drop that one message and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_rng_tracker() -> None:
    """The model-parallel RNG tracker (dropout in TP regions, checkpoint recompute) stores CUDA
    generator states. Without CUDA it tracks CPU generator states instead, with the same seeds."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    mp_random.CudaRNGStatesTracker.add = add
    logging.getLogger(mp_random.__name__).addFilter(_SilenceExpectedCpuRngWarning())


def _deepspeed_skip_shm_comm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles `deepspeed_shm_comm` whenever a communicator starts
    (~20-30 s per process). Collectives then go through torch.distributed/gloo, which is what we test."""
    # `import deepspeed.comm.torch as m` would bind the `torch` attribute of deepspeed.comm (real torch).
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def _megatron_linear_autocast_on_cpu() -> None:
    """megatron-core's tensor-parallel linear functions are `torch.autograd.Function`s whose forward and
    backward carry `custom_fwd` / `custom_bwd` for the *CUDA* autocast: the backward re-enters the
    autocast state the forward ran under, on CUDA only. Under CPU autocast (`train.precision=bf16-mixed`)
    the forward casts to bf16 but the backward then runs without autocast and multiplies the bf16
    gradient by the fp32 weight, which torch refuses. Re-decorated for the CPU's autocast, the backward
    runs as it does on a GPU."""
    import inspect

    from megatron.core.tensor_parallel import layers

    for function in (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication):
        forward, backward = inspect.unwrap(function.forward), inspect.unwrap(function.backward)
        function.forward = staticmethod(torch.amp.custom_fwd(forward, device_type="cpu"))
        function.backward = staticmethod(torch.amp.custom_bwd(backward, device_type="cpu"))


SHIMS: dict[str, Callable[[], None]] = {
    "cuda_current_device_is_cpu": _cuda_current_device_is_cpu,
    "cpu_rng_tracker": _cpu_rng_tracker,
    "deepspeed_skip_shm_comm_build": _deepspeed_skip_shm_comm_build,
    "megatron_linear_autocast_on_cpu": _megatron_linear_autocast_on_cpu,
}


def apply_cpu_shims() -> list[str]:
    """Apply every shim once, and only if CUDA is absent. Returns the names applied so far."""
    if torch.cuda.is_available():
        return []
    for name, shim in SHIMS.items():
        if name not in _APPLIED:
            shim()
            _APPLIED.append(name)
    return list(_APPLIED)
