"""The gated recurrent block: prelude, a shared core run R times with an update gate, coda.

This file is the GRT math. Everything else (embeddings, loss, noise draws, MoR, recomputation,
diagnostics, parallelism, training) lives elsewhere.

    h_pre = Prelude(e)                       h_0 = h_pre (or random)
    for r in 1..R:                           (the SAME core weights every step)
        x_r = W_in · [h_{r-1} + eps_x, h_pre]                       injection: concat_project
        o_r = Core(x_r)
        a_r = W_2 · silu(W_1 · [LN_a(h_{r-1}), LN_b(h_pre)] + b_1) + b_2      (b_2 = +4 at init)
        g_r = sigmoid(a_r / tau + eps_g)                            gate: mlp
        h_r = g_r * h_{r-1} + (1 - g_r) * o_r                       (none: o_r; residual: h_{r-1} + o_r;
                                                                     fixed: g = sigmoid(b_2 / tau), not learned)
                                                                    computed as h + sigmoid(-a)·(o − h), h in fp32
    out = Coda(h_R)

W_in and W_1 multiply concatenations of the state and h_pre, so their h_pre columns give the same product
at every step: `prelude_terms` computes it once per forward (W_in,p·h_pre, and W_1,p·LN_b(h_pre) + b_1) and
each step multiplies only the state by the state's columns, d² multiply-adds a token instead of 2d², in both
linears (flops.py counts what runs: 4d² forward FLOPs a token a step fewer than the paper's 10·R·d²).

eps_x, eps_g ~ N(0, sigma²), fresh at every step, in training only (noise.py). With `injection="add"`
x_r = h_{r-1} + eps_x + h_pre, with `injection="none"` x_r = h_{r-1} + eps_x. Mixture-of-Recursions
(`routing="expert_choice"`) replaces the gate with routers (mor.py); RRT (`lora_rank`) adds a per-recursion
delta to the core's linears (relaxed.py), selected around each step; Ouro (`exit_head`) reads every step's
state through `step_outputs` (ouro.py). The prelude, core and coda layers are
megatron-core `TransformerLayer`s held in one `layers` list (prelude first, then core, then coda), so a
dense model with the same number of unique layers has the same parameter names and a checkpoint moves
between the two unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.utils import get_pg_rank
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch.utils.hooks import RemovableHandle

from grt_megatron.device import autocast_dtype
from grt_megatron.model.config import GRTConfig
from grt_megatron.model.init import piece_rng
from grt_megatron.model.layers import StepInputs, build_layer_stack, run_layers
from grt_megatron.model.mor import build_routers, run_mor
from grt_megatron.model.noise import NOISE_GATE, NOISE_STATE, random_initial_state, recurrence_noise
from grt_megatron.model.recompute import checkpoint_step
from grt_megatron.model.relaxed import RecursionAdapters


@dataclass
class GatedRecurrentBlockSubmodules:
    layer: Union[ModuleSpec, type]
    """One transformer layer (prelude, core and coda all use it)."""
    injection: Union[ModuleSpec, type]
    """W_in: 2d -> d, no bias (row-parallel: each TP rank holds a (d × 2d/TP) slice)."""
    gate_norm: Union[ModuleSpec, type]
    """LN_a and LN_b."""
    gate_fc1: Union[ModuleSpec, type]
    """W_1: 2d -> d with bias (column-parallel)."""
    gate_fc2: Union[ModuleSpec, type]
    """W_2: d -> d with bias b_2 (row-parallel)."""


class PreludeTerms(NamedTuple):
    """What the injection and the gate's first linear take from the prelude output, computed once per
    forward (`GatedRecurrentBlock.prelude_terms`) and handed to every step. The weights are this rank's
    state columns, already in the dtype the step multiplies in (autocast's under `bf16-mixed`: cast once
    per forward, as autocast's cache casts a whole weight, not at every step)."""

    injection_weight: Optional[torch.Tensor]
    """W_in's columns that multiply the state (this TP rank's share of them; possibly none: [d, 0])."""
    injection: Optional[torch.Tensor]
    """This TP rank's partial product of W_in's h_pre columns with h_pre, [s, b, d], summed over the TP
    group (reduce-scattered under SP) with the state's partial at every step."""
    gate_weight: Optional[torch.Tensor]
    """W_1's state columns (this TP rank's rows)."""
    gate: Optional[torch.Tensor]
    """W_1's h_pre columns times LN_b(h_pre), plus b_1: [s, b, d/TP] (the whole sequence under SP)."""


class GatedRecurrentBlock(MegatronModule):
    """Prelude → R × (inject, core, gate) → coda, built from a `ModuleSpec` like megatron's TransformerBlock."""

    def __init__(self, config: GRTConfig, submodules: GatedRecurrentBlockSubmodules, init_seed: int = 0,
                 layers: Optional[Sequence[int]] = None):
        """`layers` (global indices; default all) are the layers this block builds: a pipeline unit builds
        a part. The injection, gate and routers belong to the core and are built with its layers."""
        super().__init__(config=config)
        self.config: GRTConfig = config
        d = config.hidden_size
        self.num_prelude, self.num_core = config.prelude_layers, config.core_layers
        owned = set(range(config.num_layers) if layers is None else layers)
        self.layers = build_layer_stack(submodules.layer, config, init_seed, owned)
        owns_core = any(i in owned for i in range(self.num_prelude, self.num_prelude + self.num_core))
        self.injection = None
        if config.injection == "concat_project" and owns_core:
            # Without SP the row-parallel linear splits [h, h_pre] over TP ranks itself; with SP its input
            # is prepared by `_inject` (sequence gathered, hidden split) and its output reduce-scattered.
            with piece_rng(init_seed, "injection"):
                self.injection = build_module(
                    submodules.injection, 2 * d, d, config=config, init_method=config.init_method,
                    bias=False, input_is_parallel=config.sequence_parallel, skip_bias_add=False,
                    is_expert=False,
                )
        self.injection_columns = None
        """(state columns, first state column): this TP rank's slice of W_in (its `2d/TP` input columns
        of [h, h_pre]) starts with that many of the state's, from that one on; the rest are h_pre's."""
        if self.injection is not None:
            width = self.injection.input_size_per_partition
            first = get_pg_rank(self.injection.tp_group) * width
            self.injection_columns = (max(0, min(width, d - first)), first)
        self.gate_fc1 = self.gate_fc2 = None
        if config.gate == "mlp" and owns_core:
            norm = dict(config=config, hidden_size=d, eps=config.layernorm_epsilon)
            with piece_rng(init_seed, "gate"):
                self.gate_norm_state = build_module(submodules.gate_norm, **norm)
                self.gate_norm_prelude = build_module(submodules.gate_norm, **norm)
                self.gate_fc1 = build_module(
                    submodules.gate_fc1, 2 * d, d, config=config, init_method=config.init_method,
                    bias=True, gather_output=False, skip_bias_add=False, is_expert=False,
                )
                self.gate_fc2 = build_module(
                    submodules.gate_fc2, d, d, config=config, init_method=config.init_method,
                    bias=True, input_is_parallel=True, skip_bias_add=False, is_expert=False,
                )
            with torch.no_grad():
                self.gate_fc2.bias.fill_(config.gate_bias_init)
        self.routers = build_routers(config, init_seed) if config.routing == "expert_choice" and owns_core else None
        self.lora = RecursionAdapters(config, self.core, init_seed) if config.lora_rank > 0 and owns_core else None
        """RRT: a low-rank delta per recursion on the core's linears (relaxed.py)."""
        # gate "fixed": 1 − g = sigmoid(−b/τ) and g, computed once in fp32 (exact as Python floats) rather
        # than as a new device tensor at every step.
        rate = torch.sigmoid(torch.tensor(-config.gate_bias_init / config.gate_temperature, device="cpu"))
        self.fixed_rate, self.fixed_gate = float(rate), float(1 - rate)
        self.mor_eval_routing = config.mor_eval_routing
        """MoR outside training: `threshold` (causal) or `topk`; the trainer evaluates with both."""
        self.aux_loss: Optional[torch.Tensor] = None
        """MoR's auxiliary router loss of the last training forward (unweighted), else None."""
        self.step_hooks: OrderedDict[int, Callable] = OrderedDict()
        """Called after every recurrence step as hook(h_{r-1}, h_r, g, **extra) (diagnostics.py)."""

    @property
    def prelude(self):
        return self.layers[: self.num_prelude]

    @property
    def core(self):
        return self.layers[self.num_prelude : self.num_prelude + self.num_core]

    @property
    def coda(self):
        return self.layers[self.num_prelude + self.num_core :]

    def register_step_hook(self, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(self.step_hooks)
        self.step_hooks[handle.id] = hook
        return handle

    def call_step_hooks(self, h, h_new, g, step: int, **extra) -> None:
        """Each hook gets the state before and after recurrence `step` (0-based), the gate (a tensor, a
        float for the fixed gate, None without one) and the variant's extras (model/diagnostics.py)."""
        for hook in self.step_hooks.values():
            hook(h, h_new, g, step=step, **extra)

    def _inject(self, h_in: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
        z = torch.cat([h_in, h_pre], dim=-1)
        if self.config.sequence_parallel:
            # [s/tp, b, 2d] -> [s, b, 2d/tp]. Gradients coming back are complete on every rank (the
            # hidden split's backward all-gathers them), so the sequence gather must only split them.
            z = tensor_parallel.gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=False)
            z = tensor_parallel.scatter_to_tensor_model_parallel_region(z)
        x, _ = self.injection(z)
        return x

    def _tp_input(self, x: torch.Tensor, linear) -> torch.Tensor:
        """`x` as every rank of `linear`'s TP group multiplies a slice of its columns: the whole sequence
        (SP gathers it), its gradient summed over the group in backward (SP: reduce-scattered). What
        megatron's column-parallel linear does with its input; at TP 1 nothing."""
        if self.config.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                                         group=linear.tp_group)
        if linear.tp_group.size() > 1:
            return tensor_parallel.copy_to_tensor_model_parallel_region(x, group=linear.tp_group)
        return x

    def hoists_prelude_terms(self) -> bool:
        """Whether steps take `prelude_terms`: with a concat injection or an MLP gate, except under ZeRO 3,
        whose weights exist only inside their own module's forward (there each step multiplies the
        concatenation, as the equations are written)."""
        linears = [m for m in (self.injection, self.gate_fc1) if m is not None]
        return bool(linears) and not any(hasattr(m.weight, "ds_id") for m in linears)

    def prelude_terms(self, h_pre: torch.Tensor) -> PreludeTerms:
        """The h_pre columns' products of W_in and W_1, and the state columns the steps multiply by."""
        dtype = autocast_dtype(h_pre.device.type)

        def multiplied(weight):  # cast here, once, where autocast would cast it at every step
            return weight if dtype is None else weight.to(dtype)

        injection_weight = injection = gate_weight = gate = None
        if self.injection is not None:
            weight = multiplied(self.injection.weight)
            state_columns, first = self.injection_columns
            injection_weight = weight[:, :state_columns]
            start = max(0, first + state_columns - self.config.hidden_size)  # this rank's first h_pre column
            prelude = self._tp_input(h_pre, self.injection)[..., start : start + weight.shape[1] - state_columns]
            injection = F.linear(prelude, weight[:, state_columns:])
        if self.gate_fc1 is not None:
            d = self.config.hidden_size
            weight = multiplied(self.gate_fc1.weight)
            gate_weight = weight[:, :d]
            gate = F.linear(self._tp_input(self.gate_norm_prelude(h_pre), self.gate_fc1), weight[:, d:])
            gate = gate + self.gate_fc1.bias
        return PreludeTerms(injection_weight, injection, gate_weight, gate)

    def _inject_with(self, h_in: torch.Tensor, terms: PreludeTerms) -> torch.Tensor:
        """W_in·[h_in, h_pre] from this rank's state columns and the hoisted h_pre product, summed over
        the TP group (reduce-scattered under SP) as megatron's row-parallel linear sums its partials."""
        state_columns, first = self.injection_columns
        state = self._tp_input(h_in, self.injection)[..., first : first + state_columns]
        # A new tensor each step: megatron's all-reduce writes its sum into its input.
        product = F.linear(state, terms.injection_weight) + terms.injection
        group = self.injection.tp_group
        if self.config.sequence_parallel:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(product, group=group)
        if group.size() > 1:
            return tensor_parallel.reduce_from_tensor_model_parallel_region(product, group=group)
        return product

    def recurrence_step(self, h, h_pre, inputs: StepInputs, step: int, terms: Optional[PreludeTerms] = None):
        """Step `step` (0-based): h_{r-1} -> h_r. `h` is the fp32 state (see `run_core`); `terms` the
        forward's `prelude_terms` (None: the step multiplies the concatenations itself).

        The step's noise is drawn here, outside `step_math`, so that `step_math` is pure tensor code that
        `torch.compile` captures whole (`train.compile`, parallel/compile.py): the per-sample generators
        would break its graph, and the step number never enters it, so any R reuses one compiled graph.
        Additive injection skips step 0 when the state starts as h_pre (it already *is* the prelude
        output; adding it again would double it), so `injection="add"` at R = 1 is exactly dense.
        """
        cfg = self.config
        eps_x = recurrence_noise(cfg, self.training, h, inputs.noise_seeds, step, NOISE_STATE)
        # The gate logits a have the state's shape and dtype (fp32), so eps_g is drawn like h.
        eps_g = recurrence_noise(cfg, self.training, h, inputs.noise_seeds, step, NOISE_GATE) \
            if cfg.gate == "mlp" else None
        add_prelude = cfg.injection == "add" and not (step == 0 and cfg.initial_state == "prelude")
        with self.lora.at(step) if self.lora is not None else nullcontext():
            h_new, g = self.step_math(h, h_pre, eps_x, eps_g, inputs.attention_mask, inputs.rotary_pos_emb,
                                      add_prelude, terms)
        self.call_step_hooks(h, h_new, g, step=step)
        return h_new

    def step_math(self, h, h_pre, eps_x, eps_g, attention_mask, rotary_pos_emb, add_prelude: bool,
                  terms: Optional[PreludeTerms] = None):
        """Injection, core and gate of one step, given its noise: (h_r, g_r). The injection, the core and
        the gate MLP run in the model's dtype (that of `h_pre`), the blend in fp32. `train.compile`
        replaces this method on the instance with its compiled form."""
        cfg = self.config
        dtype = h_pre.dtype
        h_in = (h if eps_x is None else h + eps_x).to(dtype)
        if cfg.injection == "concat_project":
            x = self._inject(h_in, h_pre) if terms is None else self._inject_with(h_in, terms)
            x = x.to(dtype)  # autocast's bf16 product; an fp32 stream stays fp32
        elif add_prelude:
            x = h_in + h_pre
        else:
            x = h_in
        o = run_layers(self.core, x, StepInputs(attention_mask, rotary_pos_emb)).float()
        # The gated blend g·h + (1−g)·o is written h + (1−g)·(o − h) with 1 − g = sigmoid(−a): near g = 1
        # the update (1−g)·(o − h) is small next to h, and bf16 (steps of 2^-8 near 1) rounds most of it
        # away, in g and in the sum; in fp32 it survives (tests/test_numerics.py).
        if cfg.gate == "none":
            return o, None
        if cfg.gate == "residual":
            return h + o, None
        if cfg.gate == "fixed":
            return h + self.fixed_rate * (o - h), self.fixed_gate
        if terms is None:
            a, _ = self.gate_fc1(torch.cat([self.gate_norm_state(h.to(dtype)), self.gate_norm_prelude(h_pre)], dim=-1))
        else:
            state = self._tp_input(self.gate_norm_state(h.to(dtype)), self.gate_fc1)
            a = F.linear(state, terms.gate_weight) + terms.gate
        a, _ = self.gate_fc2(F.silu(a))
        a = a.float() / cfg.gate_temperature
        rate = torch.sigmoid(-(a if eps_g is None else a + eps_g))
        return h + rate * (o - h), 1 - rate

    def core_states(self, h_pre, inputs: StepInputs, recurrences: int, grad_recurrences: int) -> Iterator[torch.Tensor]:
        """h_1 … h_R, one per step as it is computed (fp32); the first `recurrences - grad_recurrences` steps
        run without gradient (truncated backprop of the heavy-tail sampler)."""
        if self.config.initial_state == "prelude":
            # A copy even when h_pre is fp32 already: a compiled step would otherwise specialise (and
            # recompile) on its two inputs being one tensor at step 0.
            h = h_pre.to(torch.float32, copy=True)
        else:
            h = random_initial_state(self.config, self.training, h_pre, inputs.noise_seeds).float()
        no_grad_steps = recurrences - grad_recurrences
        checkpoint = self.config.checkpoint_recurrence and self.training and torch.is_grad_enabled()
        # With gradient when any step has it (they all add theirs to it), else without.
        with torch.no_grad() if no_grad_steps >= recurrences else nullcontext():
            terms = self.prelude_terms(h_pre) if self.hoists_prelude_terms() else None
        for r in range(recurrences):
            if r < no_grad_steps:
                with torch.no_grad():
                    h = self.recurrence_step(h, h_pre, inputs, r, terms)
            elif checkpoint:
                h = checkpoint_step(partial(self.recurrence_step, terms=terms), h, h_pre, inputs, r)
            else:
                h = self.recurrence_step(h, h_pre, inputs, r, terms)
            yield h

    def run_core(self, h_pre, inputs: StepInputs, recurrences: int, grad_recurrences: int):
        """R steps of the recurrence. The state is carried in fp32 from step to step and handed to the coda
        in the model's dtype."""
        if self.routers is not None:
            return run_mor(self, h_pre, inputs, recurrences)
        if recurrences < 1:
            raise ValueError(f"recurrences must be >= 1, got {recurrences}")
        for h in self.core_states(h_pre, inputs, recurrences, grad_recurrences):
            pass
        return h.to(h_pre.dtype)

    def step_outputs(self, hidden_states, attention_mask, rotary_pos_emb=None, recurrences=None,
                     noise_seeds=None) -> Iterator[torch.Tensor]:
        """Ouro (`exit_head`): Coda(h_r) for r = 1 … R, [s, b, d] in the model's dtype, one per step as it is
        computed, so that the caller can turn each into a loss before the next exists."""
        recurrences = self.config.recurrences if recurrences is None else recurrences
        if recurrences < 1:
            raise ValueError(f"recurrences must be >= 1, got {recurrences}")
        inputs = StepInputs(attention_mask, rotary_pos_emb, noise_seeds)
        h_pre = run_layers(self.prelude, hidden_states, inputs)
        for h in self.core_states(h_pre, inputs, recurrences, recurrences):
            yield run_layers(self.coda, h.to(h_pre.dtype), inputs)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None, recurrences=None,
                grad_recurrences=None, noise_seeds=None):
        """[s, b, d] -> [s, b, d]. `recurrences` defaults to the configured R (evaluation).
        `noise_seeds` (one int per sample) makes training noise a function of the sample, not of
        the rank or micro-batch that processes it; without them noise comes from the global RNG."""
        recurrences = self.config.recurrences if recurrences is None else recurrences
        grad_recurrences = recurrences if grad_recurrences is None else grad_recurrences
        inputs = StepInputs(attention_mask, rotary_pos_emb, noise_seeds)
        h_pre = run_layers(self.prelude, hidden_states, inputs)
        h = self.run_core(h_pre, inputs, recurrences, grad_recurrences)
        return run_layers(self.coda, h, inputs)
