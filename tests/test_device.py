"""Device placement: every tensor the training, checkpoint and parallel code makes comes from the one
helper (`grt_megatron.device`) or names its device, so that none reaches NCCL or a CUDA op from the host.

A CPU test cannot run NCCL; what it can do is refuse the pattern that broke GPU runs (a bare
`torch.tensor(...)` all-reduced, stacked with CUDA tensors or sent between pipeline stages) and check the
helper's choices. The paths themselves run on a GPU in `tools/gpu_check.py`.
"""

import ast
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO

# Where tensors meet collectives, the model's outputs or pipeline sends.
GUARDED = ["grt_megatron/training", "grt_megatron/checkpoint", "grt_megatron/parallel",
           "grt_megatron/distributed.py", "grt_megatron/model/recurrent_block.py",
           "grt_megatron/model/mor.py", "grt_megatron/model/noise.py", "grt_megatron/model/language_model.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "eye", "linspace"}


def _bare_factory_calls(path: Path) -> list[str]:
    """`torch.<factory>(...)` calls without a `device=` argument, as 'file:line: source'."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_tensor_is_made_without_a_device_where_collectives_run():
    files = []
    for entry in GUARDED:
        p = REPO / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    bare = [line for f in files for line in _bare_factory_calls(f)]
    assert not bare, ("make these with grt_megatron.device.device_tensor/device_zeros, or name the device "
                      "(device='cpu' for host-side data):\n" + "\n".join(bare))


def test_the_check_finds_a_bare_tensor(tmp_path):
    """The check above can fail: the pattern that crashed NCCL runs is found."""
    sample = REPO / "tests" / "_device_sample.py"
    sample.write_text("import torch\nflag = torch.tensor([0], dtype=torch.int64)\n"
                      "ok = torch.tensor([0], device='cpu')\n")
    try:
        assert [line.split(": ", 1)[0] for line in _bare_factory_calls(sample)] == ["tests/_device_sample.py:2"]
    finally:
        sample.unlink()


def test_device_helper_and_backend_on_cpu():
    from grt_megatron.device import device_tensor, device_zeros, process_group_backend, run_device

    assert run_device() == torch.device("cpu")
    assert process_group_backend() == "gloo"
    assert device_tensor([1, 2], dtype=torch.int64).device == run_device()
    assert device_zeros(2, dtype=torch.float64).dtype == torch.float64


def test_on_cuda_the_group_takes_cuda_and_cpu_tensors(monkeypatch):
    """With CUDA, tensors go to this process's GPU and the process group is NCCL for CUDA tensors plus
    gloo for host ones (a small flag on the host then cannot crash a collective)."""
    from grt_megatron import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.run_device() == torch.device("cuda", 3)
    assert device.process_group_backend() == "cpu:gloo,cuda:nccl"


def test_tensor_parallel_sets_one_cuda_connection(monkeypatch):
    from grt_megatron.device import configure_cuda

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    configure_cuda(tp=1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    configure_cuda(tp=2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the user's own value wins
    configure_cuda(tp=2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("precision,tf32,tflops", [("bf16", True, 989.0), ("fp32", True, 494.0),
                                                   ("fp32", False, 67.0)])
def test_mfu_peak_follows_tf32(monkeypatch, precision, tf32, tflops):
    from grt_megatron.training import metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops_per_device(precision, None, tf32=tf32) == tflops * 1e12


@pytest.mark.parametrize("avx512,precision,device,warns", [
    (False, "bf16", "cpu", True), (False, "bf16-mixed", "cpu", True), (False, "fp32", "cpu", False),
    (True, "bf16", "cpu", False), (False, "bf16", "cuda", False)])
def test_slow_bf16_warning_names_the_precision_only_where_bf16_is_slow(monkeypatch, avx512, precision, device,
                                                                       warns):
    from grt_megatron.device import slow_bf16_warning

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    line = slow_bf16_warning(precision, torch.device(device))
    assert (line is not None) == warns
    if warns:
        assert line.startswith("warning: ") and f"train.precision={precision}" in line and "\n" not in line
