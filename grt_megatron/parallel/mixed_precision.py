"""`train.precision=bf16-mixed`: fp32 weights, bf16 matmuls through `torch.autocast`, applied from outside.

The three precisions, and where each keeps what (bytes per parameter of model and optimizer state):
- `fp32`: fp32 everything (16: weight, gradient, two Adam moments).
- `bf16`: Megatron-LM's and DeepSpeed's way: bf16 weights and gradients in the model, an fp32 master copy,
  fp32 gradient accumulation buffers and the moments in DeepSpeed's BF16 optimizer (20). Every
  micro-batch's bf16 gradients are cast and added into the fp32 buffers, and every step copies the
  updated master weights back to bf16; the optimizer checks its norm on the host (a device sync).
- `bf16-mixed`: torchtitan's single-device and DDP way (Lightning calls it "bf16-mixed"): the weights,
  gradients and optimizer stay fp32 (16); the forward runs under `torch.autocast(bfloat16)`, so matmuls
  and attention run in bf16 on casts of the weights, and norms and softmax-like reductions in fp32. The
  layers' residual stream is bf16, as in `bf16` and unlike a plain PyTorch model under autocast:
  megatron-core's bias-dropout-add casts the residual to the sublayer output's dtype (for pipeline sends
  of one dtype), and without linear biases (every recipe) that output is bf16
  (`model.fp32_residual_connection=true` keeps the stream fp32: model/specs.py). There is no master copy
  and no copy of it back to bf16 at each step: the optimizer is the bare (fused) AdamW, the trainer
  clips on the device (step_runner.py), and a step waits for the device once (the norm for the skip
  decision, the loss read beside it, before the optimizer step is queued). The casts move instead: each
  weight is cast to bf16 in every forward and its gradient back to fp32 in every backward (the cast's
  backward), per micro-batch, as DeepSpeed's bf16 casts each micro-batch's gradients into its fp32 buffers.

The recurrence's state is fp32 in every precision (the gate's update is below bf16's resolution near
g = 1: tests/test_numerics.py). In eager mode autocast caches its cast of each weight for one forward
(the local linears hand it the weight itself, model/specs.py), so the shared core's weights are cast once
per forward and their gradients once per backward, whatever R is (a test counts them); the R uses'
gradients are summed in bf16 before that one cast, as DeepSpeed's bf16 sums them. That costs little: at
R = 16 the core's gradients are 1.0e-2 (relative) from float64's, against 9.2e-3 with a cast per use
(summed in fp32) and 1.1e-2 for the unshared prelude and coda (tests/test_mixed_precision.py). Compiled
(`train.compile`), each recurrence step is its own graph call, and a graph casts the weights it multiplies
inside itself, where autocast's cache cannot reach: the core's weights would be cast at every step, each
step's graph would keep its own bf16 copy for backward, and autograd would add R fp32 gradients. So the
compiled step gets its weights cast once per forward from outside its graph (`StepWithWeightsCastOnce`,
parallel/compile.py; MoR's core likewise), and compiled runs cast and sum as eager ones do. At the medium
GRT (68 M shared parameters, R = 4) that is 2.0 GB of casts and additions a micro-batch instead of 5.7 GB,
and one bf16 copy of the core (136 MB) kept for backward instead of R (by arithmetic; on a CPU, at the
small shape's R = 10, 11% fewer bytes saved for backward, measured by tools/bench/compile.py). Whether
bf16-mixed beats bf16 on a GPU is the GPU check's question (README, "GPU check").
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
