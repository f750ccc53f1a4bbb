"""Kernel choices (model/kernels.py): the layer spec and megatron's fusion flags per device, refusals with a
reason, the same function whichever is chosen, and checkpoints that record the recipe's `auto`."""

import pytest
import torch
from conftest import assert_same_step, loss_and_grads, tiny_config

from grt_megatron.checkpoint.compat import compare_models
from grt_megatron.model import ConfigError, GRTLanguageModel
from grt_megatron.model.kernels import FUSION_FIELDS, resolve_kernels, transformer_engine_available
from grt_megatron.model.specs import SDPACoreAttention


def _resolve(cuda, te, position_embedding="learned", activation="gelu", **recipe):
    return resolve_kernels(recipe, activation=activation, position_embedding=position_embedding, cuda=cuda, te=te)


@pytest.mark.parametrize("cuda, te, positions, spec, on", [
    (False, False, "rope", "local", set()),  # CPU: everything off
    (False, True, "rope", "local", set()),  # TE installed but no GPU: its kernels cannot run
    (True, False, "rope", "local", {"bias_dropout_fusion"}),
    (True, True, "learned", "transformer_engine", {"bias_dropout_fusion"}),
    (True, True, "rope", "transformer_engine", {"bias_dropout_fusion", "apply_rope_fusion"}),
])
def test_auto_picks_per_device(cuda, te, positions, spec, on):
    resolved = _resolve(cuda, te, positions)
    assert resolved["layer_spec"] == spec
    assert {name for name in FUSION_FIELDS if resolved[name]} == on


def test_explicit_choices_win_where_they_can_run():
    assert _resolve(True, True, layer_spec="local", bias_dropout_fusion=False)["layer_spec"] == "local"
    assert not _resolve(True, True, "rope", apply_rope_fusion=False)["apply_rope_fusion"]
    assert _resolve(False, False, bias_dropout_fusion=True)["bias_dropout_fusion"]  # runs on CPU too
    # With dropout, the compiled kernel's masks come from inductor's RNG: auto keeps the unfused layer.
    assert not resolve_kernels({}, activation="gelu", position_embedding="learned", hidden_dropout=0.1,
                               cuda=True, te=False)["bias_dropout_fusion"]


@pytest.mark.parametrize("cuda, te, recipe, message", [
    (True, True, dict(gradient_accumulation_fusion=True), "megatron DDP's `main_grad`"),
    (True, True, dict(persist_layer_norm=True), "apex's persistent FusedLayerNorm"),
    (True, True, dict(masked_softmax_fusion=True), "already one fused kernel"),
    (True, True, dict(bias_activation_fusion=True), "tanh approximation"),
    (True, True, dict(bias_activation_fusion=True, activation="silu"), "GeLU or gated SiLU only"),
    (True, True, dict(apply_rope_fusion=True), "nothing to fuse"),
    (True, False, dict(apply_rope_fusion=True, position_embedding="rope"), "transformer_engine is not importable"),
    (False, True, dict(layer_spec="transformer_engine"), "needs CUDA"),
    (True, False, dict(layer_spec="transformer_engine"), "transformer_engine is not importable"),
    (True, True, dict(layer_spec="te"), "not one of auto, local, transformer_engine"),
    (True, True, dict(bias_dropout_fusion="on"), "not one of auto, true, false"),
])
def test_what_cannot_run_or_would_change_the_function_is_refused(cuda, te, recipe, message):
    with pytest.raises(ConfigError, match="model\\.") as err:
        _resolve(cuda, te, **recipe)
    assert message in str(err.value)


def test_this_machine_builds_the_local_spec_and_records_auto(world):
    cfg = tiny_config()
    assert transformer_engine_available() == (cfg.layer_spec == "transformer_engine" and torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert cfg.layer_spec == "local" and not any(getattr(cfg, name) for name in FUSION_FIELDS)
        model = GRTLanguageModel(cfg, init_seed=0)
        assert any(isinstance(m, SDPACoreAttention) for m in model.modules())
        assert not any(type(m).__module__.startswith("transformer_engine") for m in model.modules())
    # A checkpoint says what the recipe said, so it rebuilds (and resumes) on a machine that resolves it
    # otherwise; the kernel choices may change at resume and are listed, not refused.
    saved = cfg.to_dict()
    assert saved["layer_spec"] == "auto" and all(saved[name] == "auto" for name in FUSION_FIELDS)
    assert compare_models(saved, tiny_config().to_dict()) == ([], [])
    before = {k: v for k, v in saved.items() if k not in ("layer_spec", *FUSION_FIELDS)}  # older checkpoints
    assert compare_models(before, saved) == ([], [])
    refused, applied = compare_models(saved, tiny_config(bias_dropout_fusion=True).to_dict())
    assert refused == [] and applied == ["model.bias_dropout_fusion: 'auto' -> True"]


def test_fused_bias_dropout_add_computes_the_unfused_function(world):
    # With a bias to add; without dropout, where auto takes the fusion (with it, the compiled kernel's masks
    # are inductor's, see resolve_kernels).
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for fused in (False, True):
        cfg = tiny_config(add_bias_linear=True, bias_dropout_fusion=fused)
        assert cfg.bias_dropout_fusion is fused
        model = GRTLanguageModel(cfg, init_seed=5).train()
        torch.manual_seed(11)  # the same recurrence noise and depth in both
        results.append(loss_and_grads(model, tokens))
    unfused, fused = results
    assert_same_step(fused, unfused, loss_rtol=1e-6, grad_rtol=1e-5, grad_atol=1e-7)


@pytest.mark.parametrize("bias,precision", [(False, "fp32"), (True, "fp32"), (True, "bf16")])
def test_local_linears_compute_megatrons_linear_to_the_bit(world, monkeypatch, bias, precision):
    """On one tensor-parallel rank the block's and layers' linears run `input @ weight.t() (+ bias)` through
    torch's autograd instead of megatron's Python autograd Function: the same loss and every gradient to
    the bit, with biases and in bf16 (the RRT's LoRA hooks and tied heads included)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from grt_megatron.model import specs

    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    recipes = [dict(add_bias_linear=bias), dict(add_bias_linear=bias, lora_rank=2, tie_embeddings=True)]
    for recipe in recipes:
        results, calls = [], []
        for megatron in (False, True):
            with monkeypatch.context() as patch:
                if megatron:
                    patch.setattr(specs._TorchAutogradWhenLocal, "_forward_impl", ColumnParallelLinear._forward_impl)
                else:
                    local = specs._TorchAutogradWhenLocal._forward_impl
                    patch.setattr(specs._TorchAutogradWhenLocal, "_forward_impl",
                                  lambda self, *a, **k: calls.append(type(self).__name__) or local(self, *a, **k))
                model = GRTLanguageModel(tiny_config(**recipe), init_seed=5).train()
                if precision == "bf16":
                    model = model.bfloat16()
                torch.manual_seed(11)
                results.append(loss_and_grads(model, tokens))
        assert {"ColumnLinear", "RowLinear"} <= set(calls)  # the local path ran
        # 4 linears in each of 5 layer executions (prelude, core 3×, coda), per step the gate's W_2 (3
        # steps), and the head. (W_in and W_1 are multiplied by halves: GatedRecurrentBlock.prelude_terms.)
        assert len(calls) == 4 * 5 + 3 + 1
        ours, megatrons = results
        assert torch.equal(ours[0], megatrons[0])
        assert ours[1].keys() == megatrons[1].keys()
        assert all(torch.equal(ours[1][n], megatrons[1][n]) for n in ours[1])
