"""One test per CPU shim: each one is needed (the unpatched call needs CUDA) and does its job."""

import torch

from conftest import json_from_fresh_process
from grt_megatron.cpu_shims import SHIMS, apply_cpu_shims, compile_at_first_call


def test_all_shims_applied_once_without_cuda():
    assert not torch.cuda.is_available()
    applied = apply_cpu_shims()
    assert applied == list(SHIMS)
    assert apply_cpu_shims() == applied  # idempotent


def test_current_device_names_the_cpu():
    apply_cpu_shims()
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_global_memory_buffer_allocates_on_cpu_and_reuses(world):
    from megatron.core import parallel_state

    buf = parallel_state.get_global_memory_buffer()
    a = buf.get_tensor((4, 8), torch.float32, "shim-test")
    b = buf.get_tensor((2, 8), torch.float32, "shim-test")
    assert a.device.type == "cpu" and a.shape == (4, 8) and b.shape == (2, 8)
    assert a.data_ptr() == b.data_ptr()  # one flat buffer per (name, dtype), reused
    c = buf.get_tensor((8, 8), torch.float32, "shim-test")  # grows when too small
    assert c.numel() == 64


def test_rng_tracker_forks_cpu_generator_reproducibly(world):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(5)
    # The default (data-parallel) generator is untouched by the fork.
    assert torch.equal(outside_before, torch.get_rng_state())
    tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        again = torch.rand(5)
    assert torch.equal(first, again)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        advanced = torch.rand(5)
    assert not torch.equal(first, advanced)  # the tracked state advances like a generator


def test_deepspeed_does_not_build_shm_comm_op():
    import importlib

    apply_cpu_shims()
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    assert ds_comm_torch.build_shm_op() is None
    assert not hasattr(torch, "build_shm_op")  # the patch hit DeepSpeed's module, not torch


def test_rotary_embedding_stays_on_cpu(world):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    emb = rope(8)
    assert emb.device.type == "cpu" and emb.shape == (8, 1, 1, 16)
    # Megatron's layout: the first half and the second half repeat the same frequencies.
    freqs = torch.outer(torch.arange(8, dtype=torch.float32), rope.inv_freq)
    assert torch.allclose(emb[:, 0, 0, :8], freqs) and torch.allclose(emb[:, 0, 0, 8:], freqs)


def test_megatron_linear_backward_runs_under_cpu_autocast(world):
    """Under CPU autocast (train.precision=bf16-mixed) megatron-core's linear function computes in bf16 and
    its backward gives fp32 gradients equal to those of torch's own linear under the same autocast."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    apply_cpu_shims()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=gen, requires_grad=True)
    w = torch.randn(32, 16, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_with_grad_accumulation_and_async_allreduce(x, w, None, gradient_accumulation_fusion=False,
                                                                allreduce_dgrad=False, sequence_parallel=False)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x2, w2).float().square().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-2, atol=1e-2)


def test_megatron_kernels_compile_at_first_call_and_the_import_skips_the_compiler():
    """Importing the trainer leaves torch's compiler unimported (megatron-core's fused kernels would import it
    through `torch.compile`): `jit_fuser` is `compile_at_first_call` and megatron's kernels are its wrappers."""
    script = """
import json, sys
import grt_megatron.training.trainer
import megatron.core.jit, megatron.core.activations
from grt_megatron.cpu_shims import compile_at_first_call
print("@@", json.dumps({"jit_fuser": megatron.core.jit.jit_fuser is compile_at_first_call,
                        "kernel": megatron.core.activations.quick_gelu.__code__.co_qualname,
                        "dynamo": "torch._dynamo" in sys.modules,
                        "inductor": "torch._inductor.compile_fx" in sys.modules}))
"""
    got = json_from_fresh_process(script, [], "@@", timeout=300)
    assert got == {"jit_fuser": True, "kernel": "compile_at_first_call.<locals>.call",
                   "dynamo": False, "inductor": False}


def test_megatron_kernels_compile_at_import_as_before_where_cuda_is_present():
    """With CUDA (here: torch told so before anything imports megatron-core) the hook leaves megatron as it is."""
    script = """
import json, sys, torch
torch.cuda.is_available = lambda: True
import grt_megatron, megatron.core.jit
print("@@", json.dumps({"jit_fuser": megatron.core.jit.jit_fuser is torch.compile,
                        "dynamo": "torch._dynamo" in sys.modules}))
"""
    assert json_from_fresh_process(script, [], "@@", timeout=300) == {"jit_fuser": True, "dynamo": True}


def test_compile_at_first_call_compiles_once_and_inlines_inside_a_compiled_region():
    from torch._dynamo.utils import counters

    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))

    class Scaled(torch.nn.Module):
        @compile_at_first_call(backend="eager")  # a method, as megatron decorates some
        def scaled(self, x):
            return 2 * gelu(x)

        def forward(self, x):
            return self.scaled(x) + 1

    deferred = compile_at_first_call(gelu, backend="eager")
    assert deferred.__wrapped__ is gelu and deferred.__name__ == "gelu"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    counters.clear()
    assert torch.equal(deferred(x), gelu(x))
    assert torch.equal(deferred(x + 1), gelu(x + 1))
    assert counters["stats"]["unique_graphs"] == 1  # compiled at the first call, then reused
    module = Scaled()
    assert torch.equal(module(x), 2 * gelu(x) + 1)
    # Inside a compiled region (one graph, no break allowed) the deferred method is inlined, not compiled apart.
    counters.clear()
    outer = torch.compile(module, backend="eager", fullgraph=True)
    assert torch.equal(outer(x), 2 * gelu(x) + 1)
    assert counters["stats"]["unique_graphs"] == 1
