"""The gated recurrent block: prelude, a shared core run R times with an update gate, coda.

This file is the GRT math. Everything else (embeddings, loss, parallelism, training) lives elsewhere.

    h_pre = Prelude(e)                       h_0 = h_pre (or random)
    for r in 1..R:                           (the SAME core weights every step)
        x_r = W_in · [h_{r-1} + eps_x, h_pre]                       injection: concat_project
        o_r = Core(x_r)
        a_r = W_2 · silu(W_1 · [LN_a(h_{r-1}), LN_b(h_pre)] + b_1) + b_2      (b_2 = +4 at init)
        g_r = sigmoid(a_r / tau + eps_g)                            gate: mlp
        h_r = g_r * h_{r-1} + (1 - g_r) * o_r
    out = Coda(h_R)

eps_x, eps_g ~ N(0, sigma²), fresh at every step, in training only. With `gate="none"` the update is
h_r = o_r; with `injection="add"` x_r = h_{r-1} + eps_x + h_pre, with `injection="none"` x_r = h_{r-1} + eps_x.
The prelude, core and coda layers are megatron-core `TransformerLayer`s held in one `layers` list
(prelude first, then core, then coda), so a dense model with the same number of unique layers has the
same parameter names and a checkpoint moves between the two unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from grt_megatron.model.config import GRTConfig


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


class GatedRecurrentBlock(MegatronModule):
    """Prelude → R × (inject, core, gate) → coda, built from a `ModuleSpec` like megatron's TransformerBlock."""

    def __init__(self, config: GRTConfig, submodules: GatedRecurrentBlockSubmodules):
        super().__init__(config=config)
        self.config: GRTConfig = config
        d = config.hidden_size
        self.num_prelude, self.num_core = config.prelude_layers, config.core_layers
        # Layer numbers are 1-based and unique, as megatron-core expects.
        self.layers = torch.nn.ModuleList(
            build_module(submodules.layer, config=config, layer_number=i + 1)
            for i in range(config.num_layers)
        )
        self.injection = None
        if config.injection == "concat_project":
            self.injection = build_module(
                submodules.injection, 2 * d, d, config=config, init_method=config.init_method,
                bias=False, input_is_parallel=False, skip_bias_add=False, is_expert=False,
            )
        self.gate_fc1 = self.gate_fc2 = None
        if config.gate == "mlp":
            norm = dict(config=config, hidden_size=d, eps=config.layernorm_epsilon)
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

    # ---- the pieces (a pipeline stage runs a subset of them) -------------------------------------
    @property
    def prelude(self):
        return self.layers[: self.num_prelude]

    @property
    def core(self):
        return self.layers[self.num_prelude : self.num_prelude + self.num_core]

    @property
    def coda(self):
        return self.layers[self.num_prelude + self.num_core :]

    @staticmethod
    def _run(layers, hidden, attention_mask, rotary_pos_emb):
        for layer in layers:
            hidden, _ = layer(hidden, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return hidden

    def _noise(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        if not (self.training and self.config.noise_sigma > 0):
            return None
        shape = like.shape if self.config.noise_shape == "per_element" else (*like.shape[:-1], 1)
        return torch.randn(shape, dtype=like.dtype, device=like.device) * self.config.noise_sigma

    def initial_state(self, h_pre: torch.Tensor) -> torch.Tensor:
        if self.config.initial_state == "prelude":
            return h_pre
        std = self.config.initial_state_std
        if self.training:
            return torch.randn_like(h_pre) * std
        # Evaluation and generation must be deterministic: a fixed draw, independent of global RNG.
        generator = torch.Generator(device=h_pre.device).manual_seed(0)
        return torch.randn(h_pre.shape, generator=generator, device=h_pre.device).to(h_pre.dtype) * std

    def recurrence_step(self, h, h_pre, attention_mask, rotary_pos_emb, reinject: bool = True):
        """One step r: h_{r-1} -> h_r. `reinject=False` skips additive injection on a step whose state
        already is h_pre (step 1 with `initial_state="prelude"`), so add-injection at R=1 is dense."""
        cfg = self.config
        eps_x = self._noise(h)
        h_in = h if eps_x is None else h + eps_x
        if cfg.injection == "concat_project":
            x, _ = self.injection(torch.cat([h_in, h_pre], dim=-1))
        elif cfg.injection == "add" and reinject:
            x = h_in + h_pre
        else:
            x = h_in
        o = self._run(self.core, x, attention_mask, rotary_pos_emb)
        if cfg.gate == "none":
            return o
        a, _ = self.gate_fc1(torch.cat([self.gate_norm_state(h), self.gate_norm_prelude(h_pre)], dim=-1))
        a, _ = self.gate_fc2(F.silu(a))
        a = a / cfg.gate_temperature
        eps_g = self._noise(a)
        g = torch.sigmoid(a if eps_g is None else a + eps_g)
        return g * h + (1 - g) * o

    def run_core(self, h_pre, attention_mask, rotary_pos_emb, recurrences: int, grad_recurrences: int):
        """R steps of the recurrence; the first `recurrences - grad_recurrences` run without gradient
        (truncated backprop of the heavy-tail sampler)."""
        h = self.initial_state(h_pre)
        no_grad_steps = recurrences - grad_recurrences
        checkpoint = self.config.checkpoint_recurrence and self.training and torch.is_grad_enabled()
        for r in range(recurrences):
            reinject = not (r == 0 and self.config.initial_state == "prelude")
            if r < no_grad_steps:
                with torch.no_grad():
                    h = self.recurrence_step(h, h_pre, attention_mask, rotary_pos_emb, reinject)
            elif checkpoint:
                # megatron's checkpoint restores CPU, CUDA and tracker RNG states, so the noise and
                # dropout drawn in the recompute equal those of the first forward.
                def step(h_, h_pre_, reinject=reinject):
                    return self.recurrence_step(h_, h_pre_, attention_mask, rotary_pos_emb, reinject)

                h = tensor_parallel.checkpoint(step, False, h, h_pre)
            else:
                h = self.recurrence_step(h, h_pre, attention_mask, rotary_pos_emb, reinject)
        return h

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None, recurrences=None,
                grad_recurrences=None):
        """[s, b, d] -> [s, b, d]. `recurrences` defaults to the configured R (evaluation)."""
        recurrences = self.config.recurrences if recurrences is None else recurrences
        grad_recurrences = recurrences if grad_recurrences is None else grad_recurrences
        h_pre = self._run(self.prelude, hidden_states, attention_mask, rotary_pos_emb)
        h = self.run_core(h_pre, attention_mask, rotary_pos_emb, recurrences, grad_recurrences)
        return self._run(self.coda, h, attention_mask, rotary_pos_emb)
