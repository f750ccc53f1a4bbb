"""The model's fields are declared once, in `GRTConfig` (model/config.py). The recipe fields are derived
from it; the HF export's config (`hf/configuration_grt.py`, which must import only transformers) cannot
import it, so this test holds the two together: every recipe field is either exported under a known name or
named here as training-only with the reason, and the HF config takes every exported name with a default of
the same kind."""

import dataclasses
import inspect

from conftest import tiny_config

# Recipe fields the export does not carry, and why.
TRAINING_ONLY = {
    "hidden_dropout": "inference runs without dropout",
    "attention_dropout": "inference runs without dropout",
    "noise_shape": "training noise only; inference adds none (noise_sigma is recorded)",
    "initial_state_std": "the export supports initial_state=prelude only (refused otherwise)",
    "routing": "Mixture-of-Recursions is refused by the export",
    "router_aux_loss_coeff": "MoR training loss",
    "mor_eval_routing": "MoR only",
    "exit_entropy_coeff": "Ouro training loss",
    "checkpoint_recurrence": "activation recomputation during training",
    "fp32_residual_connection": "a training precision (bf16-mixed); a transformers model runs in its load dtype",
    "make_vocab_size_divisible_by": "the export cuts the padded vocabulary to vocab_size",
    **dict.fromkeys(("layer_spec", "bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                     "gradient_accumulation_fusion", "apply_rope_fusion", "persist_layer_norm"),
                    "which kernels training runs, not the function (model/kernels.py)"),
}


def test_recipe_fields_are_exported_or_named_training_only():
    from grt_megatron.hf.convert import _CONFIG_FIELDS
    from grt_megatron.model.config import RECIPE_FIELDS

    exported = set(_CONFIG_FIELDS)
    assert exported <= set(RECIPE_FIELDS), exported - set(RECIPE_FIELDS)
    missing = set(RECIPE_FIELDS) - exported - set(TRAINING_ONLY)
    assert not missing, f"recipe fields neither exported nor named training-only: {sorted(missing)}"
    assert not exported & set(TRAINING_ONLY)
    assert set(TRAINING_ONLY) <= set(RECIPE_FIELDS), set(TRAINING_ONLY) - set(RECIPE_FIELDS)


def test_recipe_fields_are_every_field_grt_config_declares():
    from megatron.core.transformer import TransformerConfig

    from grt_megatron.model.config import MEGATRON_RECIPE_FIELDS, RECIPE_FIELDS, GRTConfig

    megatron = {f.name for f in dataclasses.fields(TransformerConfig)}
    own = [f.name for f in dataclasses.fields(GRTConfig) if f.name not in megatron]
    assert list(RECIPE_FIELDS) == [*MEGATRON_RECIPE_FIELDS, *own]
    assert len(set(RECIPE_FIELDS)) == len(RECIPE_FIELDS)
    assert tiny_config().to_dict().keys() == set(RECIPE_FIELDS)


def test_hf_config_takes_every_exported_field_with_a_default_of_its_kind():
    from grt_megatron.hf.configuration_grt import GRTConfig as HFGRTConfig
    from grt_megatron.hf.convert import hf_config_kwargs

    exported = hf_config_kwargs(tiny_config().to_dict())
    parameters = inspect.signature(HFGRTConfig.__init__).parameters
    for name, value in exported.items():
        assert name in parameters, f"hf/configuration_grt.py has no parameter {name}"
        default = parameters[name].default
        assert default is None or isinstance(value, type(default)) or (
            isinstance(default, float) and isinstance(value, int)), (name, value, default)
    config = HFGRTConfig(**exported)
    assert {name: getattr(config, name) for name in exported} == exported
