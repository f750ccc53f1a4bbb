"""The run's device, and the one way the project makes tensors on it.

A GPU run fails where a tensor meets a collective or an op on the wrong device: NCCL refuses CPU tensors
("No backend type associated with device type cpu"), and `torch.stack` refuses a CUDA and a CPU tensor
together. On CPU both mistakes pass unnoticed, so every tensor that the training, checkpoint and parallel
code makes for a collective or for the model comes from `device_tensor` / `device_zeros` here
(tests/test_device.py refuses a bare `torch.tensor(...)` in those modules). Tensors deliberately kept on
the host (checkpoint files, RNG states) say so with a `device="cpu"` of their own.

CUDA settings that must be made before the CUDA context exists, or once per process (TF32), are here too.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch


# The dtypes a command that loads or writes a trained model takes by name (`--dtype`): grt-generate,
# grt-eval and grt-convert-hf offer the same two.
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_device() -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` when CUDA is available (the launcher's LOCAL_RANK, set
    before the process group starts), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def inference_device(requested: Optional[str]) -> torch.device:
    """The device a command that runs a trained model (grt-generate) uses: `requested` (`cpu`, `cuda` or
    `cuda:N`), by default CUDA where it is available, as grt-eval and transformers' pipelines do. A device
    this machine lacks is refused with the reason (ValueError), not replaced by another."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {requested!r}: not cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        if device.index is None:  # torch.cuda.set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def hide_cuda() -> None:
    """Make this process CPU-only, as `CUDA_VISIBLE_DEVICES=` would from the shell. megatron-core and this
    project choose their kernels by whether CUDA is visible, not by where a model's tensors are: with a GPU
    present, a model meant for the CPU would get Transformer Engine's layers and RoPE tables moved to the
    GPU. torch reads the variable when it first asks for CUDA devices, so this must run before anything
    does; if something already had, the GPU stays visible and this refuses (RuntimeError) rather than let
    a CPU run take GPU kernels."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise RuntimeError("cannot hide CUDA: torch had already looked for GPUs; start the command with "
                           "CUDA_VISIBLE_DEVICES= instead")


def device_tensor(data: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`torch.tensor(data)` on the run's device (flags, counters and seeds that travel in collectives)."""
    return torch.tensor(data, dtype=dtype, device=run_device())


def device_zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=run_device())


def process_group_backend() -> str:
    """gloo on CPU. On GPU NCCL for CUDA tensors plus gloo for CPU tensors in the same group, so that a
    small host-side flag (or an object collective, which torch then runs on the CPU) cannot crash a job;
    the project's own tensors still go to NCCL on the GPU through `device_tensor`."""
    return "cpu:gloo,cuda:nccl" if run_device().type == "cuda" else "gloo"


def configure_cuda(tp: int, deterministic: bool = False) -> None:
    """Before the CUDA context is created: one hardware queue when tensor parallelism is on, so that a
    TP all-reduce issued before a GEMM runs before it (megatron-core's sequence-parallel overlap relies on
    this ordering; Megatron-LM's launch scripts set the same variable). With `deterministic`, cuBLAS gets
    the fixed workspace its deterministic mode needs, and torch refuses nondeterministic kernels (an op
    without a deterministic kernel then raises instead of silently varying). A user's own values win."""
    if tp > 1:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def set_tf32(enabled: bool) -> bool:
    """TF32 tensor cores for fp32 matmuls and convolutions on Ampere and later (PyTorch's default is off,
    i.e. full fp32 at a fraction of the speed). Returns whether TF32 is in effect on this device."""
    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast multiplies in on this device type (`train.precision=bf16-mixed`), or None where
    autocast is off, or has no such device (`meta`, on which tests/test_device.py runs the model)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def cpu_has_fast_bf16_matmuls() -> bool:
    """Whether this CPU has AVX-512 (with or without its BF16 extension, or AMX), on which oneDNN runs bf16
    matmuls at speed. Without it (AVX2) torch takes a slow path: on a 2-core AVX2 EPYC (2026-12-06), a
    [256 × 50304] @ [50304 × 128] product took 2,918 ms in bf16 against 22 ms in fp32, a layer-sized
    x @ w.t() 3.7 ms against 0.24."""
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    return True if probe is None else bool(probe())


def slow_bf16_warning(precision: str, device: torch.device) -> Optional[str]:
    """One line for the run's log when `precision` puts the matmuls in bf16 on a CPU that runs them slowly,
    else None. A warning, not a refusal: the run is right, only slow (the tests run bf16 on any CPU)."""
    if device.type != "cpu" or precision not in ("bf16", "bf16-mixed") or cpu_has_fast_bf16_matmuls():
        return None
    return (f"warning: train.precision={precision} on a CPU without AVX-512: bf16 matmuls take a slow path here "
            "(10-130x fp32's time); train.precision=fp32 (train=cpu's) is the fast choice on this machine")
