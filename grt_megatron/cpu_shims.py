"""Every patch grt-megatron applies to megatron-core and DeepSpeed so that they run without CUDA.

megatron-core 0.16 calls CUDA in places that have nothing to do with the math (scratch buffers, the RNG
tracker), and DeepSpeed compiles a shared-memory C++ op at every CPU process-group start (~20 s). The
math itself runs unchanged on CPU with gloo. Each shim below is small, named, applied at most once, and
only when CUDA is absent; `apply_cpu_shims()` returns the names of those it applied so that tests can
check each one. Nothing else in the project patches third-party code.

One shim acts earlier: megatron-core wraps its fused kernels in `torch.compile` while it is being
imported, so deferring that must be in place before the first `import megatron.core`. `grt_megatron`'s
`__init__` installs it (`defer_megatron_kernel_compile_on_cpu`); it too acts only when CUDA is absent.
This module imports torch only inside its functions, so that installing it costs a CLI nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import Callable

_APPLIED: list[str] = []


def _cuda_current_device_is_cpu() -> None:
    """megatron-core allocates with `device=torch.cuda.current_device()` in ~40 places that have nothing
    to do with CUDA: the attention scratch buffer (GlobalMemoryBuffer), the all-gather / reduce-scatter
    outputs of tensor and sequence parallelism, RoPE's frequencies. Without CUDA that call raises; here it
    names the CPU, so each of those allocations lands where the model is. Code that needs a real GPU index
    fails as it would have anyway."""
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")


class _SilenceExpectedCpuRngWarning(logging.Filter):
    """On CPU the tracker's states *are* CPU generator states, so the tracker's warning that the CPU
    RNG changed inside a fork is expected on every fork; drop that one message and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_rng_tracker() -> None:
    """The model-parallel RNG tracker (dropout in TP regions, checkpoint recompute) stores CUDA
    generator states. Without CUDA it tracks CPU generator states instead, with the same seeds."""
    import torch
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

    import torch
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
    import torch

    if torch.cuda.is_available():
        return []
    for name, shim in SHIMS.items():
        if name not in _APPLIED:
            shim()
            _APPLIED.append(name)
    return list(_APPLIED)


def compile_at_first_call(fn: Callable | None = None, **options):
    """`torch.compile` with the compiling, and the import of torch's compiler stack, put off until `fn` is
    first called; used as `torch.compile` is (`@compile_at_first_call`, or with options). Inside a region
    that is itself being compiled the plain function runs, so the outer graph inlines it, as it inlines a
    `torch.compile`d function. A plain function, not a callable object: megatron decorates methods too."""
    if fn is None:
        return lambda f: compile_at_first_call(f, **options)
    import torch  # here, at decoration (megatron's import), not at every call

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def _defer_jit_fuser(jit_module) -> None:
    import torch

    # Only the decorator this was written against: another megatron-core version may define it otherwise.
    if not torch.cuda.is_available() and getattr(jit_module, "jit_fuser", None) is torch.compile:
        jit_module.jit_fuser = compile_at_first_call


class _PatchAfterExec(importlib.abc.Loader):
    """The module's own loader, then `patch(module)` before anyone can import a name from it."""

    def __init__(self, loader, patch: Callable):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _MegatronJitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.util.find_spec(fullname)  # as the other finders would find it (editable installs too)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader, _defer_jit_fuser)
        return spec


def defer_megatron_kernel_compile_on_cpu() -> None:
    """megatron-core decorates ~40 fused elementwise kernels with `megatron.core.jit.jit_fuser`, which is
    `torch.compile`, at import. Each call imports and sets up torch's compiler (dynamo, inductor, sympy):
    about 2 s of every process start, a third of importing the trainer, though on CPU (local spec, fusion
    flags off) those kernels are seldom called. Without CUDA, `jit_fuser` becomes `compile_at_first_call`:
    the same compile with the same options, at a kernel's first call. With CUDA nothing changes.

    Installs an import hook that acts once, when `megatron.core.jit` has run and before any module has
    taken `jit_fuser` from it; it does nothing if megatron-core was imported already."""
    if "megatron.core.jit" in sys.modules or any(isinstance(f, _MegatronJitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronJitFinder())
