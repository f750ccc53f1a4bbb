"""The language-model loss: vocab-parallel cross-entropy computed a chunk of rows at a time.

megatron-core's `vocab_parallel_cross_entropy` works on fp32 logits: with bf16 logits the caller casts the
whole [s, b, V/TP] tensor to fp32 (1.6 GB for a micro-batch of 8 × 1024 tokens at a 50k vocabulary), and
that copy is kept as the softmax until backward. Here the logits stay in the model's dtype: each chunk of
rows is cast to fp32, reduced, and dropped; backward recomputes the chunk's softmax from the logits and the
saved per-row max and sum. The arithmetic per row is megatron's (subtract the max, exp, sum, log − target
logit; softmax − one-hot, times the incoming gradient), so losses and gradients match it to the bit where
the per-row reductions do, and to fp32 rounding anywhere (tests/test_loss.py). Logits that fit in one
chunk take megatron's function itself: the same memory, and faster (no softmax recompute).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.utils import VocabUtility

CHUNK_BYTES = 256 * 2**20
"""fp32 workspace of one chunk: rows per chunk = CHUNK_BYTES / (4 · V/TP)."""


def _vocab_range(partition: int) -> tuple[int, int]:
    return VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition, parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size())


def _fp32_copy(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk's one fp32 workspace, worked on in place (a copy even of fp32 logits, which backward reads)."""
    return chunk.to(torch.float32, copy=True)


def _chunk_sums(chunk: torch.Tensor, row_max: torch.Tensor, local_target: torch.Tensor):
    """(Σ exp(x − max), x[target] − max) of each row of `chunk`, as one expression: compiled
    (`fused=True`), inductor reads the logits once and never writes the fp32 rows."""
    shifted = chunk.float() - row_max.unsqueeze(-1)
    return shifted.exp().sum(dim=-1), shifted.gather(1, local_target.unsqueeze(-1)).squeeze(-1)


def _chunk_grad(chunk: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
                hit: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """(softmax − one-hot) × the incoming gradient, in the logits' dtype: one pass over the chunk compiled.
    Off the target p − 0 is p exactly, so eager it gives the in-place form's bits."""
    softmax = (chunk.float() - row_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    columns = torch.arange(chunk.shape[-1], device=chunk.device)
    one_hot = (columns == local_target.unsqueeze(-1)).float() * hit.unsqueeze(-1)
    return ((softmax - one_hot) * grad_loss.unsqueeze(-1)).to(chunk.dtype)


def _chunk_grad_into(grad: torch.Tensor, chunk: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor,
                     local_target: torch.Tensor, hit: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """`_chunk_grad` stored into `grad`, the chunk's rows of the logits' gradient. Compiled, the one pass
    stores where the gradient belongs, where a returned chunk would be written and then copied there: with bf16
    logits 4 bytes a logit instead of 8 (tools/bench/memory_traffic.py --compile)."""
    grad.copy_(_chunk_grad(chunk, row_max, sum_exp, local_target, hit, grad_loss))


def _chunk_sums_in_place(chunk: torch.Tensor, row_max: torch.Tensor, local_target: torch.Tensor):
    """`_chunk_sums` in eager, with one fp32 workspace worked on in place (megatron's arithmetic, bit for bit)."""
    shifted = _fp32_copy(chunk)
    shifted -= row_max.unsqueeze(-1)
    target_logit = shifted[torch.arange(len(shifted), device=shifted.device), local_target]
    torch.exp(shifted, out=shifted)
    return shifted.sum(dim=-1), target_logit


@functools.cache
def _fused_kernels():
    """The two chunk expressions compiled once per process, the sums and the gradient stored in place
    (shape-specialised: a full chunk and the last, shorter one are two graphs each)."""
    return torch.compile(_chunk_sums, dynamic=False), torch.compile(_chunk_grad_into, dynamic=False)


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, rows: int, fused: bool = False) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group()
        partition = logits.shape[-1]
        start, end = _vocab_range(partition)
        flat, flat_target = logits.reshape(-1, partition), target.reshape(-1)
        outside = (flat_target < start) | (flat_target >= end)  # the target is another TP rank's
        local_target = flat_target - start
        local_target[outside] = 0
        n = flat.shape[0]
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):
            row_max[i : i + rows] = flat[i : i + rows].max(dim=-1)[0].float()  # exact: max commutes with the cast
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        target_logit, sum_exp = torch.empty_like(row_max), torch.empty_like(row_max)
        chunk_sums = _fused_kernels()[0] if fused else _chunk_sums_in_place
        for i in range(0, n, rows):
            sum_exp[i : i + rows], target_logit[i : i + rows] = chunk_sums(
                flat[i : i + rows], row_max[i : i + rows], local_target[i : i + rows])
        target_logit[outside] = 0.0
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        ctx.rows, ctx.fused = rows, fused
        ctx.save_for_backward(logits, row_max, sum_exp, outside, local_target)
        return (torch.log(sum_exp) - target_logit).view_as(target)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, row_max, sum_exp, outside, local_target = ctx.saved_tensors
        rows, partition = ctx.rows, logits.shape[-1]
        flat, flat_grad_loss = logits.reshape(-1, partition), grad_loss.reshape(-1)
        hit = 1.0 - outside.float()  # the one-hot's 1 sits on this rank's slice only where the target is here
        grad = torch.empty_like(logits)  # not a view: autograd can then take it as the leaf's .grad
        flat_grad = grad.view(-1, partition)
        if ctx.fused:
            kernel = _fused_kernels()[1]
            for i in range(0, flat.shape[0], rows):
                kernel(flat_grad[i : i + rows], flat[i : i + rows], row_max[i : i + rows], sum_exp[i : i + rows],
                       local_target[i : i + rows], hit[i : i + rows], flat_grad_loss[i : i + rows])
            return grad, None, None, None
        for i in range(0, flat.shape[0], rows):
            softmax = _fp32_copy(flat[i : i + rows])
            softmax -= row_max[i : i + rows].unsqueeze(-1)
            torch.exp(softmax, out=softmax)
            softmax.div_(sum_exp[i : i + rows].unsqueeze(-1))
            softmax[torch.arange(len(softmax), device=softmax.device), local_target[i : i + rows]] -= hit[i : i + rows]
            softmax.mul_(flat_grad_loss[i : i + rows].unsqueeze(-1))
            flat_grad[i : i + rows] = softmax
            del softmax
        return grad, None, None, None


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                         chunk_bytes: int = CHUNK_BYTES, fused: bool = False) -> torch.Tensor:
    """logits [s, b, V/TP] in any float dtype, target [s, b] -> per-token loss [s, b] in fp32. `fused`
    (`train.compile`): each chunk's sums and gradient are compiled expressions, so the logits are read
    twice forward (max, sums) and once backward, against about five fp32 passes each way in eager."""
    if logits.numel() * 4 <= chunk_bytes and not fused:
        # One chunk holds it all: megatron's own function on an fp32 copy of at most one chunk costs the
        # same memory and is faster (it keeps the softmax instead of recomputing it in backward).
        return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)
    rows = max(1, chunk_bytes // (4 * logits.shape[-1]))
    return _ChunkedVocabParallelCrossEntropy.apply(logits.contiguous(), target, rows, fused)
