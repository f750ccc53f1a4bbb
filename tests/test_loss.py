"""The chunked vocab-parallel cross-entropy (model/loss.py) against megatron-core's, which needs fp32 logits:
the same losses and logit gradients, in fp32 and from bf16 logits, whatever the chunking; and no fp32 copy
of the whole logits (the largest temporary is one chunk)."""

import pytest
import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from grt_megatron.model.loss import chunked_vocab_parallel_cross_entropy


def _reference(logits, target):
    leaf = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf.float(), target)
    return loss, leaf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 7, 47, 10_000])  # 10 000: one chunk, megatron's own path
def test_chunked_loss_and_gradients_equal_megatrons(world, dtype, chunk_rows):
    s, b, v = 16, 3, 300
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(s, b, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (s, b), generator=g)
    weights = torch.rand(s, b, generator=g)  # a non-uniform incoming gradient

    want, ref_leaf = _reference(logits, target)
    (want * weights).sum().backward()

    leaf = logits.detach().clone().requires_grad_()
    got = chunked_vocab_parallel_cross_entropy(leaf, target, chunk_bytes=4 * v * chunk_rows)
    (got * weights).sum().backward()

    assert got.dtype == torch.float32 and got.shape == (s, b)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert leaf.grad.dtype == dtype
    tol = 1e-7 if dtype == torch.float32 else 0
    assert torch.allclose(leaf.grad.float(), ref_leaf.grad.float(), rtol=0, atol=tol), \
        (leaf.grad.float() - ref_leaf.grad.float()).abs().max()
    if chunk_rows < s * b:  # chunked: the logits are not modified (megatron's works in place on fp32 ones)
        assert torch.equal(leaf, logits)


def test_no_fp32_copy_of_the_whole_logits(world):
    """Live bytes during forward and backward, the bf16 logits counted in both: the chunked loss adds their
    bf16 gradient and one chunk's fp32 temporaries; megatron's path first copies them whole to fp32."""
    from tools.bench.memory_vs_r import LiveBytes

    s, b, v, rows = 64, 4, 512, 32
    target = torch.randint(0, v, (s, b))
    peaks = {}
    for name, loss_fn in (("chunked", lambda x: chunked_vocab_parallel_cross_entropy(x, target, 4 * v * rows)),
                          ("megatron", lambda x: vocab_parallel_cross_entropy(x.float(), target))):
        with LiveBytes() as live:
            logits = torch.randn(s, b, v, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
            loss_fn(logits.requires_grad_()).sum().backward()
        peaks[name] = live.peak
    bf16_bytes = s * b * v * 2
    assert peaks["chunked"] <= 2 * bf16_bytes + 3 * rows * v * 4 + 64 * s * b, peaks
    assert peaks["megatron"] >= 4 * bf16_bytes, peaks  # logits, their fp32 copy (2x), the bf16 gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunks_equal_the_eager_loss(world, dtype):
    """`fused=True` (train.compile): each chunk's sums and gradient compiled. The losses equal megatron's
    within fp32 rounding (inductor's exp rounds its own way), the gradients within one unit of the
    logits' dtype, over full chunks and a shorter last one. (Their memory is not measured here: under a
    dispatch mode such as LiveBytes, compiled code runs op by op. Inductor makes each chunk expression
    one kernel, its outputs the only buffers: the sums of each row, and the chunk's gradient, stored into
    the logits' gradient: tests/test_gpu_check.py counts its bytes.)"""
    s, b, v, rows = 16, 3, 300, 20  # 48 rows: chunks of 20, 20 and 8
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(s, b, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (s, b), generator=g)
    weights = torch.rand(s, b, generator=g)
    want, ref_leaf = _reference(logits, target)
    (want * weights).sum().backward()
    def fused(leaf):
        got = chunked_vocab_parallel_cross_entropy(leaf, target, chunk_bytes=4 * v * rows, fused=True)
        (got * weights).sum().backward()
        return got

    leaf = logits.detach().clone().requires_grad_()
    got = fused(leaf)
    assert got.dtype == torch.float32 and leaf.grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    unit = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), rtol=unit, atol=1e-7)
    assert torch.equal(leaf, logits)
