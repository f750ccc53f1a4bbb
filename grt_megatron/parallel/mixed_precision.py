"""`train.precision=bf16-mixed`: fp32 weights, bf16 matmuls through `torch.autocast`, applied from outside.

The three precisions, and where each keeps what (bytes per parameter of model and optimizer state):
- `fp32`: fp32 everything (16: weight, gradient, two Adam moments).
- `bf16`: Megatron-LM's and DeepSpeed's way: bf16 weights and gradients in the model, an fp32 master copy,
  fp32 gradient accumulation buffers and the moments in DeepSpeed's BF16 optimizer (20). Every
  micro-batch's bf16 gradients are cast and added into the fp32 buffers, and every step copies the
  updated master weights back to bf16; the optimizer checks its norm on the host (a device sync).
- `bf16-mixed`: torchtitan's single-device and DDP way (Lightning calls it "bf16-mixed"): the weights,
  gradients and optimizer stay fp32 (16); the forward runs under `torch.autocast(bfloat16)`, so matmuls
  and attention run in bf16 on casts of the weights, and norms, softmax-like reductions and the residual
  stream stay fp32. There is no master copy and no gradient copy: the optimizer is the bare (fused)
  AdamW, the trainer clips on the device (step_runner.py), and a step waits for the device once (the
  norm for the skip decision, the loss read beside it, before the optimizer step is queued).

The recurrence's state is fp32 in every precision (the gate's update is below bf16's resolution near
g = 1: tests/test_numerics.py). Autocast caches the bf16 cast of each weight for one forward, so the
shared core's weights are cast once per forward whatever R is, in eager mode; compiled, each recurrence
step's graph casts its inputs again (a few hundred MB of reads at the medium shape).
"""

from __future__ import annotations

import functools

import torch

def apply_mixed_precision(model: torch.nn.Module, precision: str, device: torch.device) -> bool:
    """With `bf16-mixed`, run `model`'s forward under autocast from now on (its instance's `forward` is
    wrapped: DeepSpeed's engine, the pipeline engine, evaluation and sampling all call it; parameter names
    and checkpoints do not change). Backward runs outside autocast, as torch requires, and follows the
    dtypes the forward recorded. Returns whether it applied."""
    if precision != "bf16-mixed":
        return False
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return True
