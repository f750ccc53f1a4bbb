"""The gradient handling sequence parallelism needs under DeepSpeed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def register_sequence_parallel_grad_hooks(model: torch.nn.Module) -> int:
    """Sum, over the tensor-parallel group, the gradients of parameters that each TP rank applies to its
    own slice of the sequence (norms, biases added after a reduce-scatter: megatron marks them with
    `sequence_parallel`). megatron-core does this in its own DDP; under DeepSpeed nothing does, and
    nothing fails without it — the loss is just silently wrong. The hook acts on each gradient before
    it is accumulated, so DeepSpeed's ZeRO hooks (which run after accumulation) see the full sum."""
    group = parallel_state.get_tensor_model_parallel_group()

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    count = 0
    for param in model.parameters():
        if param.requires_grad and getattr(param, "sequence_parallel", False):
            param.register_hook(all_reduce)
            count += 1
    return count
