"""The gated recurrent block: prelude, a shared core run R times with an update gate, coda.

This file is the GRT math. Everything else (embeddings, loss, parallelism, training) lives elsewhere.

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

Mixture-of-Recursions (`routing="expert_choice"`) replaces the gate with one router per recursion:

    A_0 = all positions;  k_r = ceil(S·(R−r+1)/R)                  (capacity shrinks with depth)
    w = sigmoid(router_r(h_t)) for t in A_{r-1};  A_r = the k_r positions of A_{r-1} with the largest w
    h_t += w_t · (Core(h_{A_r})_t − h_t) for t in A_r             (the others have left: unchanged from now on)

The core attends among the active positions only (causally); an auxiliary binary cross-entropy teaches
each router to predict its own top-k choice. The top-k compares a token's score with later tokens' scores,
so outside training the default rule is the causal one the loss prepares for: A_r = {t in A_{r-1}: w_t > 0.5}
where k_r < S (`mor_eval_routing`).

eps_x, eps_g ~ N(0, sigma²), fresh at every step, in training only. With `gate="none"` the update is
h_r = o_r; with `injection="add"` x_r = h_{r-1} + eps_x + h_pre, with `injection="none"` x_r = h_{r-1} + eps_x.
The prelude, core and coda layers are megatron-core `TransformerLayer`s held in one `layers` list
(prelude first, then core, then coda), so a dense model with the same number of unique layers has the
same parameter names and a checkpoint moves between the two unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from grt_megatron.model.config import GRTConfig, mor_capacity
from grt_megatron.model.init import piece_rng


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

    PIECES = ("prelude", "core", "coda")

    def __init__(self, config: GRTConfig, submodules: GatedRecurrentBlockSubmodules,
                 pieces: Sequence[str] = PIECES, init_seed: int = 0, only_layers: Optional[Sequence[int]] = None):
        """`pieces` (and `only_layers`, global layer indices) select what this module builds: a pipeline
        unit builds a part. Layers it does not own are `Identity` placeholders, so every layer keeps its
        global index and parameter name."""
        super().__init__(config=config)
        self.config: GRTConfig = config
        d = config.hidden_size
        self.num_prelude, self.num_core = config.prelude_layers, config.core_layers
        self.pieces = tuple(pieces)
        owned = self._layer_indices(self.pieces)
        if only_layers is not None:
            owned &= set(only_layers)

        def layer(i):
            # Layer numbers are 1-based and unique, as megatron-core expects.
            with piece_rng(init_seed, f"layer.{i}"):
                return build_module(submodules.layer, config=config, layer_number=i + 1)

        self.layers = torch.nn.ModuleList(
            layer(i) if i in owned else torch.nn.Identity() for i in range(config.num_layers))
        self.injection = None
        if config.injection == "concat_project" and "core" in self.pieces:
            # Without SP the row-parallel linear splits [h, h_pre] over TP ranks itself; with SP its input
            # is prepared by `_inject` (sequence gathered, hidden split) and its output reduce-scattered.
            with piece_rng(init_seed, "injection"):
                self.injection = build_module(
                    submodules.injection, 2 * d, d, config=config, init_method=config.init_method,
                    bias=False, input_is_parallel=config.sequence_parallel, skip_bias_add=False,
                    is_expert=False,
                )
        self.gate_fc1 = self.gate_fc2 = None
        if config.gate == "mlp" and "core" in self.pieces:
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
        self.routers = None
        if config.routing == "expert_choice" and "core" in self.pieces:
            with piece_rng(init_seed, "routers"):
                self.routers = torch.nn.ModuleList(
                    torch.nn.Linear(d, 1, bias=False, dtype=config.params_dtype) for _ in range(config.recurrences))
                for router in self.routers:
                    config.init_method(router.weight)
        self.mor_eval_routing = config.mor_eval_routing
        """MoR outside training: `threshold` (causal) or `topk`; the trainer evaluates with both."""
        self.aux_loss: Optional[torch.Tensor] = None
        """MoR's auxiliary router loss of the last training forward (unweighted), else None."""
        self.step_stats: Optional[list[dict[str, float]]] = None
        """Set to a list to record, per recurrence step, the mean gate and the relative state update
        ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ (diagnostics: does the gate learn, does the state still move)."""

    # ---- the pieces (a pipeline stage runs a subset of them) -------------------------------------
    def _layer_indices(self, pieces: Sequence[str]) -> set[int]:
        unknown = set(pieces) - set(self.PIECES)
        if unknown:
            raise ValueError(f"unknown block pieces {sorted(unknown)}; known: {self.PIECES}")
        p, k, n = self.num_prelude, self.num_core, self.config.num_layers
        ranges = {"prelude": range(0, p), "core": range(p, p + k), "coda": range(p + k, n)}
        return {i for piece in pieces for i in ranges[piece]}

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
    def _run(layers, hidden, inputs: "StepInputs"):
        for layer in layers:
            hidden, _ = layer(hidden, attention_mask=inputs.attention_mask, rotary_pos_emb=inputs.rotary_pos_emb)
        return hidden

    def _sequence_shard(self) -> tuple[int, int]:
        """(shards, index) of this rank's slice of the sequence: (TP size, TP rank) under SP."""
        if not self.config.sequence_parallel:
            return 1, 0
        return (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())

    def _noise(self, like: torch.Tensor, inputs: "StepInputs", step: int, kind: int) -> Optional[torch.Tensor]:
        if not (self.training and self.config.noise_sigma > 0):
            return None
        per_token = self.config.noise_shape == "per_token"
        return draw_noise(like, self.config.noise_sigma, per_token, inputs.noise_seeds, step, kind,
                          self._sequence_shard())

    def _inject(self, h_in: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
        z = torch.cat([h_in, h_pre], dim=-1)
        if self.config.sequence_parallel:
            # [s/tp, b, 2d] -> [s, b, 2d/tp]. Gradients coming back are complete on every rank (the
            # hidden split's backward all-gathers them), so the sequence gather must only split them.
            z = tensor_parallel.gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=False)
            z = tensor_parallel.scatter_to_tensor_model_parallel_region(z)
        x, _ = self.injection(z)
        return x

    def initial_state(self, h_pre: torch.Tensor, inputs: "StepInputs") -> torch.Tensor:
        if self.config.initial_state == "prelude":
            return h_pre
        std = self.config.initial_state_std
        shard = self._sequence_shard()
        if self.training:
            return draw_noise(h_pre, std, False, inputs.noise_seeds, 0, NOISE_INITIAL_STATE, shard)
        # Evaluation and generation must be deterministic: a fixed draw, independent of global RNG.
        s, b, d = h_pre.shape
        generator = torch.Generator(device=h_pre.device).manual_seed(0)
        full = torch.randn((s * shard[0], b, d), generator=generator, device=h_pre.device)
        return full[s * shard[1] : s * (shard[1] + 1)].to(h_pre.dtype) * std

    def recurrence_step(self, h, h_pre, inputs: "StepInputs", step: int):
        """Step `step` (0-based): h_{r-1} -> h_r. `h` is the fp32 state (see `run_core`); the injection,
        the core and the gate MLP run in the model's dtype (that of `h_pre`), the blend in fp32.

        Additive injection skips step 0 when the state starts as h_pre (it already *is* the prelude
        output; adding it again would double it), so `injection="add"` at R = 1 is exactly dense.
        """
        cfg = self.config
        dtype = h_pre.dtype
        eps_x = self._noise(h, inputs, step, NOISE_STATE)
        h_in = (h if eps_x is None else h + eps_x).to(dtype)
        if cfg.injection == "concat_project":
            x = self._inject(h_in, h_pre)
        elif cfg.injection == "add" and not (step == 0 and cfg.initial_state == "prelude"):
            x = h_in + h_pre
        else:
            x = h_in
        o = self._run(self.core, x, inputs).float()
        # The gated blend g·h + (1−g)·o is written h + (1−g)·(o − h) with 1 − g = sigmoid(−a): near g = 1
        # the update (1−g)·(o − h) is small next to h, and bf16 (steps of 2^-8 near 1) rounds most of it
        # away, in g and in the sum; in fp32 it survives (tests/test_numerics.py).
        if cfg.gate == "none":
            g, h_new = None, o
        elif cfg.gate == "residual":
            g, h_new = None, h + o
        elif cfg.gate == "fixed":
            rate = torch.sigmoid(torch.tensor(-cfg.gate_bias_init / cfg.gate_temperature, device=h.device))
            g, h_new = 1 - rate, h + rate * (o - h)
        else:
            a, _ = self.gate_fc1(torch.cat([self.gate_norm_state(h.to(dtype)), self.gate_norm_prelude(h_pre)],
                                           dim=-1))
            a, _ = self.gate_fc2(F.silu(a))
            a = a.float() / cfg.gate_temperature
            eps_g = self._noise(a, inputs, step, NOISE_GATE)
            rate = torch.sigmoid(-(a if eps_g is None else a + eps_g))
            g, h_new = 1 - rate, h + rate * (o - h)
        if self.step_stats is not None:
            self._record_stats(h, h_new, g)
        return h_new

    @torch.no_grad()
    def _record_stats(self, h, h_new, g, **extra: float) -> None:
        update = (h_new - h).float().norm() / h.float().norm().clamp_min(1e-12)
        self.step_stats.append({"gate_mean": float("nan") if g is None else float(g.float().mean()),
                                "relative_update": float(update), **extra})

    mor_capacity = staticmethod(mor_capacity)

    def run_mor(self, h_pre: torch.Tensor, inputs: "StepInputs", recurrences: int) -> torch.Tensor:
        """Mixture-of-Recursions with expert-choice routing (see the module docstring). h: [s, b, d],
        carried in fp32 like the gated state; routers and core run in the model's dtype."""
        dtype = h_pre.dtype
        h = h_pre.float()
        s, b, d = h.shape
        trained = self.config.recurrences
        if recurrences > trained:
            raise ValueError(f"MoR has routers for {trained} recursions; cannot run {recurrences}")
        causal = not self.training and self.mor_eval_routing == "threshold"
        # The tokens still recurring, as positions in ascending order, one column per sequence. Under the
        # causal threshold sequences keep different numbers of tokens: a column is padded at its end with
        # positions that have left (`valid` False), which no real token attends to under causal attention.
        active = torch.arange(s, device=h.device).unsqueeze(1).expand(s, b)
        valid = torch.ones(s, b, dtype=torch.bool, device=h.device)
        aux = []
        for r in range(recurrences):
            candidates = h.gather(0, active.unsqueeze(-1).expand(-1, -1, d))
            logits = self.routers[r](candidates.to(dtype)).squeeze(-1).float()  # [n, b]
            n, k = active.shape[0], self.mor_capacity(s, trained, r)
            if causal:
                # sigmoid > 0.5: the token's own score alone decides. Where training keeps every token
                # (capacity S, the first recursion), so does evaluation.
                keep = valid if k >= s else valid & (logits > 0)
            elif k >= n:
                keep = valid
            else:
                keep = torch.zeros_like(valid).scatter_(0, logits.topk(k, dim=0).indices, True)
            if self.training:
                aux.append(F.binary_cross_entropy_with_logits(logits, keep.float()))
            # Kept tokens first, in position order; a column with fewer of them is padded by left ones.
            index = torch.arange(n, device=h.device).unsqueeze(1)
            width = int(keep.sum(0).max())
            chosen = torch.where(keep, index, index + n).argsort(dim=0)[:width]
            active, valid = active.gather(0, chosen), keep.gather(0, chosen)
            if width == 0:  # every token has left
                break
            x = candidates.gather(0, chosen.unsqueeze(-1).expand(-1, -1, d))
            # The compact sequence keeps the positions' order, so the layers' causal attention is causal
            # among the active tokens: a token attends to the earlier tokens that are still recurring.
            o = self._run(self.core, x.to(dtype), inputs).float()
            w = torch.sigmoid(logits.gather(0, chosen)).unsqueeze(-1)
            update = torch.where(valid.unsqueeze(-1), x + w * (o - x), x)
            h_new = h.scatter(0, active.unsqueeze(-1).expand(-1, -1, d), update)
            if self.step_stats is not None:
                self._record_stats(h, h_new, w[valid], active_fraction=float(valid.sum()) / (s * b))
            h = h_new
        self.aux_loss = torch.stack(aux).sum() if aux else None
        return h.to(dtype)

    def run_core(self, h_pre, inputs: "StepInputs", recurrences: int, grad_recurrences: int):
        """R steps of the recurrence; the first `recurrences - grad_recurrences` run without gradient
        (truncated backprop of the heavy-tail sampler). The state is carried in fp32 from step to step
        and handed to the coda in the model's dtype."""
        if self.routers is not None:
            return self.run_mor(h_pre, inputs, recurrences)
        h = self.initial_state(h_pre, inputs).float()
        no_grad_steps = recurrences - grad_recurrences
        checkpoint = self.config.checkpoint_recurrence and self.training and torch.is_grad_enabled()
        for r in range(recurrences):
            if r < no_grad_steps:
                with torch.no_grad():
                    h = self.recurrence_step(h, h_pre, inputs, r)
            elif checkpoint:
                h = checkpoint_step(self.recurrence_step, h, h_pre, inputs, r)
            else:
                h = self.recurrence_step(h, h_pre, inputs, r)
        return h.to(h_pre.dtype)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None, recurrences=None,
                grad_recurrences=None, noise_seeds=None):
        """[s, b, d] -> [s, b, d]. `recurrences` defaults to the configured R (evaluation).
        `noise_seeds` (one int per sample) makes training noise a function of the sample, not of
        the rank or micro-batch that processes it; without them noise comes from the global RNG."""
        recurrences = self.config.recurrences if recurrences is None else recurrences
        grad_recurrences = recurrences if grad_recurrences is None else grad_recurrences
        inputs = StepInputs(attention_mask, rotary_pos_emb, noise_seeds)
        h_pre = self._run(self.prelude, hidden_states, inputs)
        h = self.run_core(h_pre, inputs, recurrences, grad_recurrences)
        return self._run(self.coda, h, inputs)


@dataclass
class StepInputs:
    """What every layer execution of one forward pass shares."""

    attention_mask: torch.Tensor
    rotary_pos_emb: Optional[torch.Tensor] = None
    noise_seeds: Optional[Sequence[int]] = None


NOISE_STATE, NOISE_GATE, NOISE_INITIAL_STATE = 0, 1, 2


def checkpoint_step(step_fn, h, h_pre, inputs: StepInputs, r: int) -> torch.Tensor:
    """`step_fn(h, h_pre, inputs, r)`, its activations recomputed in backward (memory flat in R).

    Non-reentrant (`use_reentrant=False`): the recompute runs inside the one backward pass, so each shared
    core weight still gets one gradient-accumulation event per backward. megatron's reentrant checkpoint
    runs a backward per recurrence instead, which DeepSpeed ZeRO 2 refuses ("Gradient computed twice")
    and ZeRO 3 asserts on. torch restores the CPU and CUDA generators for the recompute; megatron's
    model-parallel tracker (dropout inside TP regions) is restored by `_tracker_states_as_in_forward`, so
    the recompute draws the dropout masks of the first forward. Noise is keyed by sample and needs neither.
    """
    def run(h_, h_pre_):
        return step_fn(h_, h_pre_, inputs, r)

    return torch.utils.checkpoint.checkpoint(run, h, h_pre, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_tracker_states_as_in_forward)


def _tracker_states_as_in_forward():
    """(forward context, recompute context) for `torch.utils.checkpoint`: the recompute runs with the RNG
    tracker's states as they were when the forward began, and puts back the states it found."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    at_forward = {name: state.clone() for name, state in tracker.get_states().items()}

    @contextmanager
    def recompute():
        found = {name: state.clone() for name, state in tracker.get_states().items()}
        tracker.set_states({name: state.clone() for name, state in at_forward.items()})
        try:
            yield
        finally:
            tracker.set_states(found)

    return nullcontext(), recompute()


def draw_noise(like: torch.Tensor, sigma: float, per_token: bool, seeds: Optional[Sequence[int]],
               step: int, kind: int, sequence_shard: tuple[int, int] = (1, 0)) -> torch.Tensor:
    """N(0, sigma²) noise shaped like `like` ([s, b, d]; [s, b, 1] per token).

    With `seeds`, sample i's noise at (step, kind) comes from its own generator, so a sample gets the
    same noise in every parallel layout, in a checkpoint recompute and after a resume. Under sequence
    parallelism `like` is this rank's slice (`sequence_shard` = (shards, index)) of the sequence: the
    sample's full-length noise is drawn and the slice kept.
    """
    s, b, d = like.shape
    width = 1 if per_token else d
    if seeds is None:
        return torch.randn((s, b, width), dtype=like.dtype, device=like.device) * sigma
    if len(seeds) != b:
        raise ValueError(f"{len(seeds)} noise seeds for a batch of {b}")
    shards, index = sequence_shard
    columns = []
    for seed in seeds:
        mixed = np.random.SeedSequence([int(seed), step, kind]).generate_state(1, np.uint64)[0]
        generator = torch.Generator(device=like.device).manual_seed(int(mixed) & (2**63 - 1))
        full = torch.randn((s * shards, width), generator=generator, device=like.device)
        columns.append(full[s * index : s * (index + 1)])
    return (torch.stack(columns, dim=1) * sigma).to(like.dtype)
