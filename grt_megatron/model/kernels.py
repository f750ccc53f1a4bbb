"""Which kernels a model runs: the layer spec (local PyTorch or Transformer Engine) and megatron-core's
fusion flags, chosen per device from recipe values `auto`, `true` or `false`.

They change speed, not the model: every choice computes the same function within rounding, keeps the same
parameter names (so a checkpoint written on a GPU with Transformer Engine resumes, converts and evaluates
on a CPU without it), and may change when a run resumes. A checkpoint records what the recipe said
(`auto`), not what one machine resolved it to. A flag that cannot work here, or would silently change the
function, is refused with the reason rather than quietly ignored.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Mapping, Optional

import torch

from grt_megatron.errors import ConfigError

LAYER_SPECS = ("local", "transformer_engine")
FUSION_FIELDS = ("bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                 "gradient_accumulation_fusion", "apply_rope_fusion", "persist_layer_norm")
KERNEL_FIELDS = ("layer_spec",) + FUSION_FIELDS

# Flags no configuration of this framework can use, with why (an explicit `true` is refused with it).
_UNSUPPORTED = {
    "masked_softmax_fusion": "attention is already one fused kernel: torch's scaled_dot_product_attention (local "
                             "spec) or Transformer Engine's fused attention; there is no separate masked softmax",
    "gradient_accumulation_fusion": "it accumulates into megatron DDP's `main_grad` buffers, and the data-parallel "
                                    "engine here is DeepSpeed, which keeps its own gradient buffers",
    "persist_layer_norm": "it selects apex's persistent FusedLayerNorm; the norms here are torch's (local spec) or "
                          "Transformer Engine's",
}


def transformer_engine_available() -> bool:
    """Transformer Engine's PyTorch package is installed (its kernels then need CUDA to run)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _choice(name: str, value: Any) -> Optional[bool]:
    """A fusion flag's recipe value: None for `auto`, else the bool."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool):
        return value
    raise ConfigError(f"model.{name}={value!r} is not one of auto, true, false")


def resolve_kernels(recipe: Mapping[str, Any], *, activation: str, position_embedding: str,
                    hidden_dropout: float = 0.0, cuda: Optional[bool] = None, te: Optional[bool] = None
                    ) -> dict[str, Any]:
    """The layer spec and fusion flags to build with, from the recipe's values (missing: `auto`).

    `auto` means: Transformer Engine's layers, and its fused RoPE when positions are rotary, where it is
    importable and CUDA is present; megatron's fused bias-dropout-add (a torch.compile'd elementwise kernel)
    on CUDA without hidden dropout; everything else off. With dropout the compiled kernel draws its masks
    from inductor's RNG, not megatron's tracker: another (equally random) mask than the unfused layer's, so
    a TP or PP layout would no longer reproduce one process; an explicit `true` still takes it.
    `cuda` and `te` default to this machine's.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = transformer_engine_available() if te is None else te
    unknown = sorted(set(recipe) - set(KERNEL_FIELDS))
    if unknown:
        raise ValueError(f"not kernel fields: {unknown}")

    spec = recipe.get("layer_spec", "auto")
    if spec is None or spec == "auto":
        spec = "transformer_engine" if te and cuda else "local"
    elif spec not in LAYER_SPECS:
        raise ConfigError(f"model.layer_spec={spec!r} is not one of auto, {', '.join(LAYER_SPECS)}")
    elif spec == "transformer_engine" and not te:
        raise ConfigError("model.layer_spec=transformer_engine: transformer_engine is not importable here "
                          "(install transformer-engine[pytorch] for your CUDA, or use auto / local)")
    elif spec == "transformer_engine" and not cuda:
        raise ConfigError("model.layer_spec=transformer_engine needs CUDA; this machine has none (use auto / local)")

    out: dict[str, Any] = {"layer_spec": spec}
    choices = {name: _choice(name, recipe.get(name, "auto")) for name in FUSION_FIELDS}
    for name, why in _UNSUPPORTED.items():
        if choices[name]:
            raise ConfigError(f"model.{name}=true is not supported: {why}")
        out[name] = False

    if choices["bias_activation_fusion"]:
        why = ("megatron's fused bias-GeLU is the tanh approximation, another function than the exact GeLU of "
               "the unfused layer and of the Hugging Face export" if activation == "gelu" else
               f"megatron fuses the bias with GeLU or gated SiLU only, and model.activation={activation!r}")
        raise ConfigError(f"model.bias_activation_fusion=true is not supported: {why} (train.compile fuses the "
                          "bias and activation exactly instead)")
    out["bias_activation_fusion"] = False

    rope = choices["apply_rope_fusion"]
    if rope and position_embedding != "rope":
        raise ConfigError(f"model.apply_rope_fusion=true has nothing to fuse: model.position_embedding="
                          f"{position_embedding!r} (set it to rope, or leave apply_rope_fusion auto)")
    if rope and not (te and cuda):
        raise ConfigError("model.apply_rope_fusion=true needs Transformer Engine's fused RoPE kernel on CUDA "
                          f"({'transformer_engine is not importable' if not te else 'no CUDA here'}; use auto)")
    out["apply_rope_fusion"] = (te and cuda and position_embedding == "rope") if rope is None else rope

    bda = choices["bias_dropout_fusion"]
    out["bias_dropout_fusion"] = (cuda and hidden_dropout == 0) if bda is None else bda
    return out


def describe_kernels(config) -> str:
    """One line for the run's log: the spec and the fusions in effect."""
    on = [name for name in FUSION_FIELDS if getattr(config, name)]
    return f"layer spec {config.layer_spec}; fusions: {', '.join(on) if on else 'none'}"
