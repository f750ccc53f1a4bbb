"""`train.compile`: torch.compile applied from outside the model, as torchtitan does.

What is compiled, and why these regions:
- the recurrence step (`GatedRecurrentBlock.step_math`: injection, the core layers, the gate and the fp32
  blend) as one graph per block. It takes its noise as inputs and never sees the step number, so every
  step of every R runs the same graph: a varying depth (the depth sampler, the depth sweep) never
  recompiles. The noise draws, the truncated-backprop `no_grad` steps, recurrence checkpointing and the
  diagnostics' step hooks stay eager around it. Under `bf16-mixed` its linears' weights are cast once per
  forward, outside the graph (`StepWithWeightsCastOnce`; MoR's core: `MoRCoreWithWeightsCastOnce`), as eager
  autocast casts them.
- every other transformer layer (prelude, coda, a dense model's layers, MoR's core) on its own, with
  `Module.compile`, which keeps parameter names: checkpoints of compiled and eager runs are the same files.
The embedding and the head stay eager. The loss keeps its chunked form (model/loss.py, never the whole
logits in fp32), with each chunk's arithmetic compiled: the softmax sums in one read of the logits, the
gradient in one pass, where eager makes about five fp32 passes each way over every chunk.

Graphs are specialised on shapes (`dynamic=False`): a run has one micro-batch shape in training and one in
evaluation. `compiled_graphs` counts the graphs dynamo built; grt-train logs it, so a recompile shows in the metrics.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from megatron.core import parallel_state, utils as megatron_utils

from grt_megatron.device import autocast_dtype
from grt_megatron.model.recurrent_block import GatedRecurrentBlock
from grt_megatron.model.specs import ColumnLinear, RowLinear
from grt_megatron.parallel.traceable_tp import register_traceable_tp

@functools.cache  # once per process
def register_traceable_megatron() -> None:
    """Two megatron-core helpers that every layer's forward calls break dynamo's graph; while tracing,
    dynamo runs these equivalents instead (`torch.compiler.substitute_in_graph`; eager code is untouched):
    - `get_tensor_model_parallel_group_if_none` warns (a deprecation notice) when handed None, which
      RowParallelLinear always does: dynamo cannot trace `warnings.warn` with a warning category;
    - `make_viewless_tensor` sets `.data` on a new tensor so that a layer's output holds no reference to
      the buffer it is a view of: dynamo refuses `.data` mutation, and a compiled graph's outputs are
      not views of its freed intermediates anyway."""

    @torch.compiler.substitute_in_graph(megatron_utils.get_tensor_model_parallel_group_if_none)
    def tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if not torch.distributed.is_initialized():
            return None
        if tp_group is not None or not parallel_state.is_initialized():
            return tp_group
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    @torch.compiler.substitute_in_graph(megatron_utils.make_viewless_tensor)
    def viewless_tensor(inp, requires_grad, keep_graph):
        return inp


def apply_compile(model: torch.nn.Module, cast_weights_once: bool = True) -> int:
    """Compile every `GatedRecurrentBlock`'s recurrence step and every layer outside it, in place, and
    switch the loss to its compiled chunk kernels. Returns the number of regions compiled.
    `cast_weights_once=False` leaves autocast's casts of the step's weights inside its graph (what
    `StepWithWeightsCastOnce` and `MoRCoreWithWeightsCastOnce` replace; for tools/bench/compile.py to
    compare)."""
    register_traceable_megatron()
    register_traceable_tp()
    regions = 0
    for module in model.modules():  # the model, or a pipeline and its units: whichever computes the loss
        if hasattr(module, "fused_loss"):
            module.fused_loss = True
    for block in [m for m in model.modules() if isinstance(m, GatedRecurrentBlock)]:
        in_step = set()
        if block.routers is not None and cast_weights_once:
            block.run_core = MoRCoreWithWeightsCastOnce(block)
        if block.routers is None and any(not isinstance(layer, torch.nn.Identity) for layer in block.core):
            # An instance attribute shadows the method: `recurrence_step` calls the compiled one.
            block.step_math = torch.compile(block.step_math, dynamic=False)
            if cast_weights_once:
                block.step_math = StepWithWeightsCastOnce(block, block.step_math)
            in_step = {id(layer) for layer in block.core}
            regions += 1
        for layer in block.layers:
            if not isinstance(layer, torch.nn.Identity) and id(layer) not in in_step:
                layer.compile(dynamic=False)
                regions += 1
    return regions


def _autocast_dtype(device: torch.device, linears: list) -> Optional[torch.dtype]:
    """The dtype autocast would cast the linears' weights to, or None where nothing is to hoist: no
    autocast, no local linears, or ZeRO 3 (whose weights are gathered only inside each linear's forward)."""
    if not linears or any(hasattr(linear.weight, "ds_id") for linear in linears):
        return None
    return autocast_dtype(device.type)


@contextmanager
def _weights_replaced(linears: list, casts: list):
    """Each linear's `weight` is its cast while inside (the compiled graphs read it from there)."""
    weights = [linear._parameters["weight"] for linear in linears]
    for linear, cast in zip(linears, casts):
        linear._parameters["weight"] = cast
    try:
        yield
    finally:
        for linear, weight in zip(linears, weights):
            linear._parameters["weight"] = weight


def _local_linears(*parts) -> list:
    return [m for part in parts if part is not None for m in part.modules() if isinstance(m, (ColumnLinear, RowLinear))]


class StepWithWeightsCastOnce:
    """The compiled recurrence step, its linears' weights cast to autocast's dtype once per forward.

    Under `train.precision=bf16-mixed` a compiled step casts every weight it multiplies inside its graph,
    so the shared core's weights were cast R times a forward, and their gradients cast back to fp32 and
    added in fp32 R times a backward, where eager autocast casts each weight once per forward (its cast
    cache, which lives outside any graph). Here the casts move out of the graph: at a forward's first step
    each local linear's weight is cast once, and every step of that forward runs the compiled graph with
    the cast in the weight's place, so autograd sums the R steps' bf16 gradients before one cast back, as
    eager mode does (tests/test_compile.py counts the casts). A forward is known by its prelude output
    `h_pre`, which every step of it gets, recomputed ones included (held weakly: the casts go when it
    does), by the grad mode (the truncated-backprop steps run without gradient and must not lend their
    casts to the steps with) and by the weights' versions (an optimizer step changes them in place).
    Without autocast, and under ZeRO 3, the step runs as compiled."""

    def __init__(self, block: GatedRecurrentBlock, compiled_step: Callable):
        self.compiled_step = compiled_step
        # The injection's and W_1's state columns come cast already (`GatedRecurrentBlock.prelude_terms`).
        self.linears = _local_linears(*block.core, block.gate_fc2)
        self._forward: Optional[tuple] = None
        self._casts: list[torch.Tensor] = []

    def _weight_casts(self, h_pre: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        weights = [linear.weight for linear in self.linears]
        key = (torch.is_grad_enabled(), dtype, tuple(w._version for w in weights))
        if self._forward is None or self._forward[0]() is not h_pre or self._forward[1] != key:
            self._casts = [w.to(dtype) for w in weights]
            self._forward = (weakref.ref(h_pre, self._release), key)
        return self._casts

    def _release(self, ref) -> None:
        if self._forward is not None and self._forward[0] is ref:  # not a later forward's
            self._forward, self._casts = None, []

    def __call__(self, h, h_pre, *args):
        dtype = _autocast_dtype(h_pre.device, self.linears)
        if dtype is None:
            return self.compiled_step(h, h_pre, *args)
        with _weights_replaced(self.linears, self._weight_casts(h_pre, dtype)):
            return self.compiled_step(h, h_pre, *args)


class MoRCoreWithWeightsCastOnce:
    """Mixture-of-Recursions' core (`run_core`, its layers compiled one by one), its linears' weights cast
    to autocast's dtype once per forward, as `StepWithWeightsCastOnce` does for the recurrence step: every
    recursion runs the compiled layers on the same casts. MoR recomputes nothing (recurrence
    checkpointing is refused with it), so the casts live for the call."""

    def __init__(self, block: GatedRecurrentBlock):
        self.run_core = block.run_core
        self.linears = _local_linears(*block.core)

    def __call__(self, h_pre, *args):
        dtype = _autocast_dtype(h_pre.device, self.linears)
        if dtype is None:
            return self.run_core(h_pre, *args)
        with _weights_replaced(self.linears, [linear.weight.to(dtype) for linear in self.linears]):
            return self.run_core(h_pre, *args)


def compiled_graphs() -> int:
    """Graphs dynamo has built in this process so far. After the first training step and the first
    evaluation it stays constant: a rise is a recompile (grt-train logs it as `compiled_graphs`)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
