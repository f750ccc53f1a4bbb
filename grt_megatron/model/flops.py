"""Closed-form parameter counts and FLOPs per token, from the recurrences actually executed.

Forward FLOPs per token (PAPER_NOTES): (P + K·R + C)·(24d² + 4Sd) + 10·R·d² for the gate and projection,
generalised here to any FFN width, to the variants without gate/projection, and with the output layer
(2·d·V) reported as its own term. The projection W_in and the gate's W_1 multiply [state, h_pre]: their
h_pre halves are multiplied once per forward, not at every step (`GatedRecurrentBlock.prelude_terms`), so
the gate and projection count 6·R·d² + 4·d², the products that run (tests/test_model.py counts them with
torch's FLOP counter). Under ZeRO 3 the steps multiply the whole concatenations (10·R·d²); the extra 4·d²
a step is not counted, as recomputation is not. Training counts 3× forward for steps with gradient and 1× for the
heavy-tail sampler's no-grad steps; recomputation from activation checkpointing is not model FLOPs.
RRT's deltas count 2·rank·(in + out) per relaxed linear per step. Ouro runs the coda, the LM head and the
exit head at every step in training: its forward counts them R times (evaluation at a fixed R runs them once).
"""

from __future__ import annotations

from grt_megatron.model.config import GRTConfig, mor_capacity
from grt_megatron.model.depth_sampler import DepthDraw
from grt_megatron.model.relaxed import lora_parameters_per_layer


def _layer_flops(cfg: GRTConfig, seq_len: int) -> int:
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    linear = 2 * (4 * d * d + 2 * d * f)  # QKV + output projection, MLP up + down
    attention = 4 * seq_len * d  # scores and weighted sum, full (not causal-halved) as in the paper
    return linear + attention


def _recurrence_extra_flops(cfg: GRTConfig) -> int:
    """A step's products besides the core's layers: the state's half of W_in and of W_1, W_2, RRT's deltas."""
    d = cfg.hidden_size
    flops = 0
    if cfg.injection == "concat_project":
        flops += 2 * d * d
    if cfg.gate == "mlp":
        flops += 2 * (d * d + d * d)
    if cfg.lora_rank:
        flops += 2 * cfg.core_layers * lora_parameters_per_layer(d, cfg.ffn_hidden_size, cfg.lora_rank)
    return flops


def _prelude_terms_flops(cfg: GRTConfig) -> int:
    """Once per forward: the h_pre halves of W_in and W_1 (`GatedRecurrentBlock.prelude_terms`)."""
    d = cfg.hidden_size
    return 2 * d * d * ((cfg.injection == "concat_project") + (cfg.gate == "mlp"))


def _mor_flops(cfg: GRTConfig, seq_len: int, recurrences: int) -> tuple[float, float]:
    """(core layer FLOPs, router FLOPs) per token of MoR: recursion r runs on its capacity's share of the
    tokens, attending over that many positions."""
    layers = routers = 0.0
    active = seq_len
    for r in range(recurrences):
        routers += 2 * cfg.hidden_size * active / seq_len
        active = mor_capacity(seq_len, cfg.recurrences, r)
        layers += cfg.core_layers * _layer_flops(cfg, active) * active / seq_len
    return layers, routers


def forward_flops_per_token(cfg: GRTConfig, seq_len: int, recurrences: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token by part, and `total` (output layer included)."""
    r = cfg.recurrences if recurrences is None else recurrences
    parts = {
        "layers": cfg.depth(r) * _layer_flops(cfg, seq_len),
        "recurrence": r * _recurrence_extra_flops(cfg) + (_prelude_terms_flops(cfg) if r else 0),
        "output_layer": 2 * cfg.hidden_size * cfg.padded_vocab_size,
    }
    if cfg.exit_head:  # Ouro: coda, final norm, LM head and exit head at every step
        parts["layers"] = (cfg.prelude_layers + r * (cfg.core_layers + cfg.coda_layers)) * _layer_flops(cfg, seq_len)
        parts["output_layer"] *= r
        parts["recurrence"] += r * 2 * cfg.hidden_size
    if cfg.routing != "none":  # MoR: tokens leave early, so the core runs on fewer tokens each recursion
        core, routers = _mor_flops(cfg, seq_len, r)
        parts["layers"] = (cfg.prelude_layers + cfg.coda_layers) * _layer_flops(cfg, seq_len) + round(core)
        parts["recurrence"] = round(routers)
    parts["total"] = sum(parts.values())
    return parts


def train_flops_per_token(cfg: GRTConfig, seq_len: int, draw: DepthDraw) -> int:
    """Model FLOPs of one training step per token: 3× forward, except 1× for no-grad core steps. After
    them, the first step with gradient gets a state without one: W_in's state half computes no input
    gradient there (W_1's does: LN_a's weights have one)."""
    full = forward_flops_per_token(cfg, seq_len, draw.recurrences)["total"]
    no_grad_core = draw.no_grad_recurrences * (
        cfg.core_layers * _layer_flops(cfg, seq_len) + _recurrence_extra_flops(cfg)
    )
    untracked_state = 2 * cfg.hidden_size ** 2 if draw.no_grad_recurrences and cfg.injection == "concat_project" else 0
    return 3 * full - 2 * no_grad_core - untracked_state


def count_parameters(cfg: GRTConfig) -> dict[str, int]:
    """Unique parameters by part (closed form, no model built); `total` counts tied weights once."""
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.padded_vocab_size
    bias = 1 if cfg.add_bias_linear else 0
    norm = 2 * d if cfg.normalization == "LayerNorm" else d
    layer = (
        norm + (3 * d * d + 3 * d * bias) + (d * d + d * bias)  # LN, QKV, attention output
        + norm + (d * f + f * bias) + (f * d + d * bias)  # LN, MLP up, MLP down
    )
    parts = {
        "embedding": v * d + (cfg.max_sequence_length * d if cfg.position_embedding == "learned" else 0),
        "layers": cfg.num_layers * layer,
        "injection": 2 * d * d if cfg.injection == "concat_project" else 0,
        "gate": (2 * norm + 2 * d * d + d + d * d + d) if cfg.gate == "mlp" else 0,
        "routers": cfg.recurrences * d if cfg.routing != "none" else 0,
        "lora": cfg.recurrences * cfg.core_layers * lora_parameters_per_layer(d, f, cfg.lora_rank),
        "exit_head": d + 1 if cfg.exit_head else 0,
        "final_norm": norm,
        "output_layer": 0 if cfg.tie_embeddings else v * d,
    }
    parts["total"] = sum(parts.values())
    return parts


def pipeline_unit_flops(cfg: GRTConfig, seq_len: int, units: list[str]) -> list[int]:
    """Forward FLOPs per token of each pipeline unit, named as `parallel.layout.pipeline_unit_names` names
    them: embedding (a lookup: 0), layer.<i>, core (all R recurrences with injection and gate), final_norm
    (0), head (2·d·V). What stages are balanced by: the head of a GPT-2 vocabulary costs several layers
    (3.5 at the medium shape), so counting layers alone would leave it on an overloaded last stage."""
    layer = _layer_flops(cfg, seq_len)
    cost = {"embedding": 0, "final_norm": 0, "head": 2 * cfg.hidden_size * cfg.padded_vocab_size,
            "core": cfg.recurrences * (cfg.core_layers * layer + _recurrence_extra_flops(cfg))
            + _prelude_terms_flops(cfg)}
    return [layer if name.startswith("layer.") else cost[name] for name in units]
