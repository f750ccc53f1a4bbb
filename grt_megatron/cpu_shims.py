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


def _cpu_global_memory_buffer() -> None:
    """`GlobalMemoryBuffer.get_tensor` allocates its scratch tensors on `torch.cuda.current_device()`.

    DotProductAttention takes its `baddbmm` output buffer from it, so without this no attention runs.
    The replacement keeps the same contract (one reusable flat buffer per (name, dtype)) on the CPU.
    """
    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for size in tensor_shape:
            numel *= size
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buffer
        return buffer[:numel].view(*tensor_shape)

    GlobalMemoryBuffer.get_tensor = get_tensor


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


def _cpu_rotary_embedding() -> None:
    """`RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on first use.
    Without CUDA it stays where the model is; the frequencies and layout are megatron's own."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0):
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb


def _deepspeed_skip_shm_comm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles `deepspeed_shm_comm` whenever a communicator starts
    (~20-30 s per process). Collectives then go through torch.distributed/gloo, which is what we test."""
    # `import deepspeed.comm.torch as m` would bind the `torch` attribute of deepspeed.comm (real torch).
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


SHIMS: dict[str, Callable[[], None]] = {
    "cpu_global_memory_buffer": _cpu_global_memory_buffer,
    "cpu_rng_tracker": _cpu_rng_tracker,
    "cpu_rotary_embedding": _cpu_rotary_embedding,
    "deepspeed_skip_shm_comm_build": _deepspeed_skip_shm_comm_build,
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
