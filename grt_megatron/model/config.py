"""The GRT model configuration: megatron-core's `TransformerConfig` plus the recurrence fields.

A model is written `P+K×R+C`: P prelude layers, a K-layer core run R times, C coda layers.
Dense GPT is `gate="none", injection="none", recurrences=1` (see `GRTConfig.dense`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from grt_megatron.errors import ConfigError
from grt_megatron.model.kernels import FUSION_FIELDS, KERNEL_FIELDS, LAYER_SPECS, resolve_kernels
from grt_megatron.parallel.layout import check_replica_layout

INJECTIONS = ("concat_project", "add", "none")
GATES = ("mlp", "none", "residual", "fixed")
NOISE_SHAPES = ("per_token", "per_element")
INITIAL_STATES = ("prelude", "random")
POSITION_EMBEDDINGS = ("learned", "rope")
DEPTH_SAMPLERS = ("fixed", "uniform", "heavy_tail")
ROUTINGS = ("none", "expert_choice")
MOR_EVAL_ROUTINGS = ("threshold", "topk")
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}

# use_cpu_initialization is fixed for every device (not a recipe field): weights are drawn whole on the CPU
# and then split, so a TP or PP layout starts from the exact weights of one process (model/init.py);
# DeepSpeed then moves them to the GPU. The layer spec and megatron's fusion flags are recipe fields
# (`auto` by default), resolved per device in model/kernels.py.
_PORTABLE_DEFAULTS = dict(use_cpu_initialization=True)


def mor_capacity(seq_len: int, recurrences: int, step: int) -> int:
    """MoR: tokens per sequence that run recursion `step` (0-based) of R: ceil(S·(R − step)/R)."""
    return math.ceil(seq_len * (recurrences - step) / recurrences)


@dataclass
class GRTConfig(TransformerConfig):
    """Everything that defines a GRT (or dense, or depth-reuse baseline) language model."""

    vocab_size: int = 50304
    """Tokenizer vocabulary; the embedding is padded to `padded_vocab_size`."""

    max_sequence_length: int = 1024

    prelude_layers: int = 1
    core_layers: int = 1
    coda_layers: int = 1
    recurrences: int = 1
    """R: core repetitions at evaluation/inference, and the upper bound (or mean) when training."""

    injection: str = "concat_project"
    """How the prelude output re-enters the core: `concat_project` (W_in·[h+eps, h_pre]), `add`
    (h+eps+h_pre) or `none` (h+eps)."""

    gate: str = "mlp"
    """`mlp`: h_r = g*h + (1-g)*o with g = sigmoid(MLP([LN(h), LN(h_pre)])/tau + eps); `none`: h_r = o.
    Ablations without a learned gate: `residual`: h_r = h + o; `fixed`: g = sigmoid(gate_bias_init/tau),
    a constant step size (what an `mlp` gate that never learns amounts to)."""

    gate_bias_init: float = 4.0
    gate_temperature: float = 1.0
    noise_sigma: float = 0.1
    noise_shape: str = "per_token"
    initial_state: str = "prelude"
    initial_state_std: float = 0.02

    tie_embeddings: bool = True
    position_embedding: str = "learned"
    rotary_base: int = 10000

    depth_sampler: str = "uniform"
    heavy_tail_sigma: float = 0.5
    heavy_tail_k: int = 8

    routing: str = "none"
    """`expert_choice`: Mixture-of-Recursions. Recursion r has its own router (sigmoid of a linear score);
    each sequence's top ceil(S·(R−r+1)/R) tokens among those still active run the core, scaled by their
    router weight (h += w·(Core(h) − h)); the others have left and skip every later recursion. Requires
    gate/injection none, no noise, a fixed depth, learned positions, one process per model replica."""
    router_aux_loss_coeff: float = 0.01
    """Weight of MoR's auxiliary loss: binary cross-entropy teaching each router's sigmoid to predict its
    own top-k choice, so that a causal threshold (0.5) can replace top-k at generation time."""
    mor_eval_routing: str = "threshold"
    """Which tokens MoR recurs outside training (training is always top-k): `threshold`, a token stays while
    its router's sigmoid is > 0.5 (all stay where training's capacity is the whole sequence), which depends
    on earlier tokens only (what decoding can do); `topk`, the
    training rule, whose per-sequence top-k compares a token's score with later tokens' scores, so its loss
    is not that of a causal language model."""

    exit_head: bool = False
    """Ouro-style looped LM (`ouro.py`): every recurrence step's state goes through the coda, the final norm
    and the LM head, and a learned exit head (`Linear(d, 1)` on the normed state, lambda_t = sigmoid) gives
    the exit distribution p_t = lambda_t * prod_{j<t}(1 - lambda_j), the last step taking the remainder.
    Training minimises sum_t p_t CE_t - beta H(p); evaluation reports the last step (`loss`) and the exit
    rule. Requires gate/injection none, no noise, a fixed depth, one process per model replica."""
    exit_entropy_coeff: float = 0.05
    """beta of the Ouro loss: the weight of the exit distribution's entropy (0.05 is Ouro's stage-I value)."""
    exit_threshold: float = 0.5
    """Ouro's exit rule: a token leaves at the first step where the cumulative exit probability reaches it."""
    lora_rank: int = 0
    """Relaxed Recursive Transformer (`relaxed.py`): > 0 adds a rank-`lora_rank` delta B_r A_r per recursion
    to every linear of the core layers, so recursion r runs W + B_r A_r (B_r = 0 at init). Recursions past
    the trained R reuse the last delta. 0: the plain shared core."""

    checkpoint_recurrence: bool = False
    """Recompute each recurrence step in backward so activation memory does not grow with R."""

    layer_spec: str = "local"
    """The transformer layers' modules: `local` (megatron-core's PyTorch layers with torch's fused attention)
    or `transformer_engine` (TE's GEMMs, norms and fused attention, same parameter names). A recipe writes
    `auto` (TE where importable with CUDA) and the fusion flags `auto`/true/false: model/kernels.py."""

    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        for name, allowed in (
            ("injection", INJECTIONS),
            ("gate", GATES),
            ("noise_shape", NOISE_SHAPES),
            ("initial_state", INITIAL_STATES),
            ("position_embedding", POSITION_EMBEDDINGS),
            ("depth_sampler", DEPTH_SAMPLERS),
            ("routing", ROUTINGS),
            ("mor_eval_routing", MOR_EVAL_ROUTINGS),
            ("layer_spec", LAYER_SPECS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"model.{name}={value!r} is not one of {', '.join(allowed)}")
        for name in ("prelude_layers", "coda_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("hidden_size", "num_attention_heads", "core_layers", "recurrences", "vocab_size",
                     "max_sequence_length", "heavy_tail_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ConfigError(f"model.ffn_hidden_size must be >= 1, got {self.ffn_hidden_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("init_method_std", "layernorm_epsilon", "heavy_tail_sigma"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"model.{name} must be a finite number > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.initial_state_std) and self.initial_state_std >= 0):
            raise ConfigError(f"model.initial_state_std must be a finite number >= 0, got {self.initial_state_std}")
        for name in ("gate_bias_init", "noise_sigma", "gate_temperature"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"model.{name} must be finite, got {getattr(self, name)}")
        if self.noise_sigma < 0:
            raise ConfigError(f"model.noise_sigma must be >= 0, got {self.noise_sigma}")
        if self.gate_temperature <= 0:
            raise ConfigError(f"model.gate_temperature must be > 0, got {self.gate_temperature}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.initial_state == "random" and self.injection == "none" and self.gate != "mlp":
            # Only the injection and the mlp gate read the prelude's output: without both, the state starts
            # from noise and no step ever sees the tokens, so the model's output would not depend on its input.
            raise ConfigError(f"model.initial_state='random' with model.injection='none' and model.gate="
                              f"{self.gate!r}: nothing carries the prelude's output (the tokens) into the "
                              "recurrence; use initial_state=prelude, an injection, or the mlp gate")
        if self.routing != "none":
            self._check_mor()
        if self.exit_head:
            self._check_ouro()
        if self.lora_rank < 0:
            raise ConfigError(f"model.lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_rank > self.hidden_size:  # a delta's rank cannot exceed the smaller side of d x d, d x 4d
            raise ConfigError(f"model.lora_rank={self.lora_rank} exceeds model.hidden_size={self.hidden_size}: a "
                              "rank-r delta of a d-wide linear has rank at most d, the rest only costs memory")
        if self.lora_rank and self.routing != "none":
            raise ConfigError("model.lora_rank > 0 (RRT) cannot be combined with model.routing (MoR): "
                              "choose one depth-reuse baseline")
        check_replica_layout(self, tp=self.tensor_model_parallel_size, sp=self.sequence_parallel, pp=1)
        # megatron-core's TransformerConfig counts unique layers; the executed depth is in `depth()`.
        self.num_layers = self.prelude_layers + self.core_layers + self.coda_layers
        super().__post_init__()

    def _check_mor(self) -> None:
        required = {"gate": "none", "injection": "none", "depth_sampler": "fixed", "position_embedding": "learned",
                    "initial_state": "prelude", "noise_sigma": 0.0, "checkpoint_recurrence": False}
        for name, value in required.items():
            if getattr(self, name) != value:
                raise ConfigError(f"model.routing={self.routing!r} (MoR) needs model.{name}={value!r}, got "
                                  f"{getattr(self, name)!r}: its routers replace the gate and decide the depth")
        if self.router_aux_loss_coeff < 0:
            raise ConfigError(f"model.router_aux_loss_coeff must be >= 0, got {self.router_aux_loss_coeff}")

    def _check_ouro(self) -> None:
        required = {"gate": "none", "injection": "none", "depth_sampler": "fixed", "noise_sigma": 0.0,
                    "routing": "none"}
        for name, value in required.items():
            if getattr(self, name) != value:
                raise ConfigError(f"model.exit_head=true (Ouro) needs model.{name}={value!r}, got "
                                  f"{getattr(self, name)!r}: a looped LM feeds each step's output to the next")
        if not (math.isfinite(self.exit_entropy_coeff) and self.exit_entropy_coeff >= 0):
            raise ConfigError(f"model.exit_entropy_coeff must be a finite number >= 0, got {self.exit_entropy_coeff}")
        if not 0 < self.exit_threshold <= 1:
            raise ConfigError(f"model.exit_threshold must be in (0, 1], got {self.exit_threshold}")

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of 128 × TP, as Megatron-LM pads it."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def depth(self, recurrences: int | None = None) -> int:
        """Layer executions per token: P + K·R + C."""
        r = self.recurrences if recurrences is None else recurrences
        return self.prelude_layers + self.core_layers * r + self.coda_layers

    @property
    def shape_name(self) -> str:
        return f"{self.prelude_layers}+{self.core_layers}x{self.recurrences}+{self.coda_layers}"

    @property
    def is_dense(self) -> bool:
        return self.recurrences == 1 and self.gate == "none" and self.injection == "none"

    def to_dict(self) -> dict[str, Any]:
        """The recipe-level fields (plain data), enough to rebuild this config with `from_recipe`. The kernel
        fields are given as the recipe wrote them (`auto`), so that the config rebuilds on any machine."""
        out = {name: getattr(self, name) for name in RECIPE_FIELDS}
        out.update(getattr(self, "kernel_recipe", {}))
        return out

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_recipe(
        cls, recipe: Mapping[str, Any], *, precision: str = "fp32", **parallel: Any
    ) -> "GRTConfig":
        """Build from a hydra model recipe (a flat mapping); unknown keys are refused by name."""
        recipe = dict(recipe)
        recipe.pop("name", None)
        unknown = sorted(set(recipe) - set(RECIPE_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {', '.join(unknown)}; known fields: {', '.join(RECIPE_FIELDS)}"
            )
        activation = recipe.pop("activation", "gelu")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"model.activation={activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if precision not in ("fp32", "bf16", "bf16-mixed"):
            raise ConfigError(f"train.precision={precision!r} is not one of fp32, bf16, bf16-mixed")
        if recipe.get("fp32_residual_connection") and precision == "bf16":
            # The norms' bf16 weights cannot normalise an fp32 stream (torch refuses the mixed LayerNorm).
            raise ConfigError("model.fp32_residual_connection=true needs train.precision=bf16-mixed (under bf16 "
                              "the weights are bf16, and the norms cannot take an fp32 stream)")
        kernel_recipe = {name: recipe.pop(name, "auto") for name in KERNEL_FIELDS}
        kwargs = dict(_PORTABLE_DEFAULTS)
        kwargs.update(recipe)
        kwargs.update(parallel)
        kwargs.update(resolve_kernels(kernel_recipe, activation=activation,
                                      position_embedding=recipe.get("position_embedding", "learned"),
                                      hidden_dropout=recipe.get("hidden_dropout", 0.0)))
        kwargs["activation_func"] = ACTIVATIONS[activation]
        # bf16-mixed keeps fp32 weights; autocast casts them in the forward (parallel/mixed_precision.py).
        kwargs["bf16"] = precision == "bf16"
        kwargs["params_dtype"] = torch.bfloat16 if precision == "bf16" else torch.float32
        try:
            config = cls(**kwargs)
        except TypeError as err:  # a wrong type in a recipe surfaces here
            raise ConfigError(f"model recipe: {err}") from None
        config.kernel_recipe = kernel_recipe
        return config

    @property
    def activation(self) -> str:
        for name, fn in ACTIVATIONS.items():
            if fn is self.activation_func:
                return name
        raise ConfigError(f"activation {self.activation_func} has no recipe name")


# Fields a recipe may set: these megatron-core TransformerConfig fields, then every field GRTConfig declares
# (in declaration order, so the list is written once: adding a GRTConfig field makes it a recipe field).
# Everything else in TransformerConfig keeps megatron-core's default.
MEGATRON_RECIPE_FIELDS = (
    "hidden_size", "num_attention_heads", "ffn_hidden_size", "normalization", "activation", "add_bias_linear",
    "hidden_dropout", "attention_dropout", "init_method_std", "layernorm_epsilon", "fp32_residual_connection",
    *FUSION_FIELDS,
)
_MEGATRON_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
RECIPE_FIELDS = MEGATRON_RECIPE_FIELDS + tuple(
    f.name for f in dataclasses.fields(GRTConfig) if f.name not in _MEGATRON_FIELDS)
