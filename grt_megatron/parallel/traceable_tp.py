"""megatron-core's tensor- and sequence-parallel communication as torch.compile traces it.

megatron's region functions (`copy_to_tensor_model_parallel_region`, `reduce_scatter_to_sequence_parallel_
region`, ...) are autograd Functions around in-place c10d collectives into buffers they allocate. Dynamo
rewrites those into functional collectives, and torch 2.13 traces them right, but torch 2.11 (the GPU
machine's) drops what the backward's all-gathers write: compiled at TP 2 + SP, every gradient of a tiny
GRT came out wrong while the loss was right (grad norm 0.53 against 1.27). While dynamo traces, these
equivalents stand in (`torch.compiler.substitute_in_graph`; eager code runs megatron's own): torch's
functional collectives, whose autograd is torch's (`all_gather_tensor_autograd`, `reduce_scatter_tensor_
autograd`) or a small Function here for the pairs torch has none of (identity one way, all-reduce or split
the other). The numbers are megatron's: the same collectives on the same tensors, in the same directions.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings

def _group(group):
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


class _AllReduceGradient(torch.autograd.Function):
    """Forward: the input; backward: its gradient summed over the group (megatron's copy-to-region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class _AllReduceForward(torch.autograd.Function):
    """Forward: the input summed over the group; backward: the gradient (megatron's reduce-from-region)."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x.contiguous(), "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFirstSplitGradient(torch.autograd.Function):
    """Forward: the shards concatenated along dim 0; backward: this rank's slice of the gradient
    (megatron's sequence gather whose incoming gradient is already complete on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.all_gather_tensor(x.contiguous(), 0, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size(), dim=0)[ctx.group.rank()].contiguous(), None


class _SplitLastGatherGradient(torch.autograd.Function):
    """Forward: this rank's slice along the last dimension; backward: the slices' gradients concatenated
    (megatron's scatter-to-region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group.size(), dim=-1)[group.rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        # Gathered along dim 0 and rearranged here: torch 2.11's gather along another dim breaks the graph.
        stacked = funcol.all_gather_tensor(grad.contiguous(), 0, ctx.group)
        return torch.cat(stacked.chunk(ctx.group.size(), dim=0), dim=-1), None


@functools.cache
def register_traceable_tp() -> None:
    """Register the stand-ins once per process (before the first compiled call traces)."""

    @torch.compiler.substitute_in_graph(mappings.copy_to_tensor_model_parallel_region)
    def copy_to_tensor_model_parallel_region(input_, group=None):
        group = _group(group)
        return input_ if group.size() == 1 else _AllReduceGradient.apply(input_, group)

    @torch.compiler.substitute_in_graph(mappings.reduce_from_tensor_model_parallel_region)
    def reduce_from_tensor_model_parallel_region(input_, group=None):
        group = _group(group)
        return input_ if group.size() == 1 else _AllReduceForward.apply(input_, group)

    @torch.compiler.substitute_in_graph(mappings.scatter_to_tensor_model_parallel_region)
    def scatter_to_tensor_model_parallel_region(input_, group=None):
        group = _group(group)
        return input_ if group.size() == 1 else _SplitLastGatherGradient.apply(input_, group)

    @torch.compiler.substitute_in_graph(mappings.gather_from_sequence_parallel_region)
    def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                             output_split_sizes=None, use_global_buffer=False):
        group = _group(group)
        if group.size() == 1:
            return input_
        if output_split_sizes is not None:
            raise NotImplementedError("uneven sequence shards under torch.compile")
        if tensor_parallel_output_grad:
            return funcol.all_gather_tensor_autograd(input_.contiguous(), 0, group)
        return _GatherFirstSplitGradient.apply(input_, group)

    @torch.compiler.substitute_in_graph(mappings.reduce_scatter_to_sequence_parallel_region)
    def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                                   use_global_buffer=False):
        group = _group(group)
        if group.size() == 1:
            return input_
        if input_split_sizes is not None:
            raise NotImplementedError("uneven sequence shards under torch.compile")
        return funcol.reduce_scatter_tensor_autograd(input_.contiguous(), "sum", 0, group)
