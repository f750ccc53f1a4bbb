"""Device placement: every tensor the training, checkpoint and parallel code makes comes from the one
helper (`grt_megatron.device`) or names its device, so that none reaches NCCL or a CUDA op from the host.

A CPU test cannot run NCCL; what it can do is refuse the pattern that broke GPU runs (a bare
`torch.tensor(...)` all-reduced, stacked with CUDA tensors or sent between pipeline stages) and check the
helper's choices, and it can run every model variant (and the exported model) on the `meta` device, where
an op that meets a host tensor is refused as on a GPU. The paths themselves run on a GPU in `tools/gpu_check.py`.
"""

import ast
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO

# Where tensors meet collectives, the model's outputs or pipeline sends.
GUARDED = ["grt_megatron/training", "grt_megatron/checkpoint", "grt_megatron/parallel",
           "grt_megatron/distributed.py", "grt_megatron/model/recurrent_block.py",
           "grt_megatron/model/mor.py", "grt_megatron/model/noise.py", "grt_megatron/model/language_model.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "eye", "linspace"}


def _bare_factory_calls(path: Path) -> list[str]:
    """`torch.<factory>(...)` calls without a `device=` argument, as 'file:line: source'."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_tensor_is_made_without_a_device_where_collectives_run():
    files = []
    for entry in GUARDED:
        p = REPO / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    bare = [line for f in files for line in _bare_factory_calls(f)]
    assert not bare, ("make these with grt_megatron.device.device_tensor/device_zeros, or name the device "
                      "(device='cpu' for host-side data):\n" + "\n".join(bare))


def test_the_check_finds_a_bare_tensor(tmp_path):
    """The check above can fail: the pattern that crashed NCCL runs is found."""
    sample = REPO / "tests" / "_device_sample.py"
    sample.write_text("import torch\nflag = torch.tensor([0], dtype=torch.int64)\n"
                      "ok = torch.tensor([0], device='cpu')\n")
    try:
        assert [line.split(": ", 1)[0] for line in _bare_factory_calls(sample)] == ["tests/_device_sample.py:2"]
    finally:
        sample.unlink()


def test_device_helper_and_backend_on_cpu():
    from grt_megatron.device import device_tensor, device_zeros, process_group_backend, run_device

    assert run_device() == torch.device("cpu")
    assert process_group_backend() == "gloo"
    assert device_tensor([1, 2], dtype=torch.int64).device == run_device()
    assert device_zeros(2, dtype=torch.float64).dtype == torch.float64


def test_on_cuda_the_group_takes_cuda_and_cpu_tensors(monkeypatch):
    """With CUDA, tensors go to this process's GPU and the process group is NCCL for CUDA tensors plus
    gloo for host ones (a small flag on the host then cannot crash a collective)."""
    from grt_megatron import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.run_device() == torch.device("cuda", 3)
    assert device.process_group_backend() == "cpu:gloo,cuda:nccl"


def test_tensor_parallel_sets_one_cuda_connection(monkeypatch):
    from grt_megatron.device import configure_cuda

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    configure_cuda(tp=1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    configure_cuda(tp=2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the user's own value wins
    configure_cuda(tp=2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("precision,tf32,tflops", [("bf16", True, 989.0), ("fp32", True, 494.0),
                                                   ("fp32", False, 67.0)])
def test_mfu_peak_follows_tf32(monkeypatch, precision, tf32, tflops):
    from grt_megatron.training import metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops_per_device(precision, None, tf32=tf32) == tflops * 1e12


@pytest.mark.parametrize("avx512,precision,device,warns", [
    (False, "bf16", "cpu", True), (False, "bf16-mixed", "cpu", True), (False, "fp32", "cpu", False),
    (True, "bf16", "cpu", False), (False, "bf16", "cuda", False)])
def test_slow_bf16_warning_names_the_precision_only_where_bf16_is_slow(monkeypatch, avx512, precision, device,
                                                                       warns):
    from grt_megatron.device import slow_bf16_warning

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    line = slow_bf16_warning(precision, torch.device(device))
    assert (line is not None) == warns
    if warns:
        assert line.startswith("warning: ") and f"train.precision={precision}" in line and "\n" not in line


# ---- every model variant, run on a device that is not the host ------------------------------------------
# The static check above sees only the guarded files' factory calls. This runs the model itself: built on
# the host (as training builds it), moved whole to the `meta` device (as DeepSpeed moves it to the GPU), then
# forward and backward there. A meta op refuses a host tensor as a CUDA op does ("not on the expected
# device"), so a tensor made on the host inside any variant's forward or backward fails here on CPU.
EXPERIMENTS = sorted(p.stem for p in (REPO / "recipes" / "experiment" / "cpu").glob("*.yaml") if p.stem != "base")
EXTRA = {"rope": ["++model.position_embedding=rope"], "checkpointed": ["++model.checkpoint_recurrence=true"],
         "random_h0": ["++model.initial_state=random"], "per_element": ["++model.noise_shape=per_element"]}


def _experiment_config(experiment: str, extra: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from grt_megatron.model import GRTConfig

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment=cpu/{experiment}", *extra])  # ++: dense has no such fields
    recipe = OmegaConf.to_container(cfg.model, resolve=True)
    recipe.update(vocab_size=300, max_sequence_length=32)
    return GRTConfig.from_recipe(recipe)


def _run_on_meta(config, train: bool):
    from grt_megatron.model import GRTLanguageModel

    model = GRTLanguageModel(config).to("meta").train(train)
    if model.rotary_pos_emb is not None:
        # megatron-core keeps RoPE's inverse frequencies off the module's tensors and moves them to the
        # current CUDA device at the first forward (which `meta` has no hook for): do that move here.
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to("meta")
    if not train and config.routing == "expert_choice":
        # MoR's causal threshold keeps a data-dependent number of tokens, which the host reads (one sync per
        # recursion, by design); meta tensors hold no values. Top-k evaluation runs the same ops without it.
        model.block.mor_eval_routing = "topk"
    tokens = torch.zeros((2, 17), dtype=torch.long, device="meta")
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss.device.type == "meta" and loss.shape == (2, 16)
    if train:
        loss.mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert all(g is not None and g.device.type == "meta" for g in grads.values()), \
            [n for n, g in grads.items() if g is None or g.device.type != "meta"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_cpu_experiment_trains_and_evaluates_off_the_host(world, experiment):
    config = _experiment_config(experiment, [])
    _run_on_meta(config, train=True)
    _run_on_meta(config, train=False)


@pytest.mark.parametrize("extra", sorted(EXTRA))
@pytest.mark.parametrize("experiment", ["grt_isoflops", "dense", "mor_isoflops", "ouro_isoflops", "rrt_isoflops"])
def test_model_switches_train_and_evaluate_off_the_host(world, experiment, extra):
    from grt_megatron.errors import ConfigError

    try:
        config = _experiment_config(experiment, EXTRA[extra])
    except ConfigError as err:  # a switch the variant refuses (MoR, Ouro: no noise, learned positions, ...)
        pytest.skip(f"{experiment} refuses {extra}: {err}")
    _run_on_meta(config, train=True)
    if extra != "random_h0":  # evaluation's fixed h_0 comes from a generator on the state's device; meta has none
        _run_on_meta(config, train=False)


def test_running_off_the_host_finds_a_tensor_made_on_the_host(world):
    """The check above can fail: a forward that adds a host tensor (what broke GPU runs) is refused on meta."""
    from grt_megatron.model import GRTLanguageModel

    model = GRTLanguageModel(_experiment_config("grt_isoflops", [])).to("meta")
    model.final_norm.register_forward_hook(lambda module, args, out: out + torch.ones(out.shape[-1]))
    tokens = torch.zeros((2, 17), dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        model(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("experiment,extra", [("grt_isoflops", []),
                                              ("grt_isoflops", ["++model.position_embedding=rope"]),
                                              ("grt_isoflops", ["++model.injection=add"]), ("dense", []),
                                              ("ouro_isoflops", []), ("rrt_isoflops", []),
                                              ("ablation_no_reinjection", [])])
def test_the_exported_model_runs_off_the_host(world, experiment, extra):
    """The Hugging Face model (what users run on their GPUs through transformers) on meta: without and with
    the per-recurrence and the averaged K/V cache (a prompt, then one more token), Ouro's exit rule, and a
    training step. A GRT's adaptive exit is left out: it stops the loop when no token is left, which the host
    must read (one sync per recurrence, by design), and meta tensors hold no values."""
    from grt_megatron.hf.convert import _hf_classes, hf_config_kwargs

    hf_config, causal_lm = _hf_classes()
    model = causal_lm(hf_config(**hf_config_kwargs(_experiment_config(experiment, extra).to_dict()))).to("meta")
    ids = torch.zeros((2, 5), dtype=torch.long, device="meta")
    with torch.no_grad():
        model.eval()
        assert model(ids, use_cache=False).logits.device.type == "meta"
        for kv_cache in ("per_recurrence", "average"):
            out = model(ids, use_cache=True, kv_cache=kv_cache)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            assert model(ids[:, :1], cache=cache, use_cache=True, kv_cache=kv_cache).logits.shape[1] == 1
        if model.config.exit_head:
            assert model(ids, use_cache=False, exit_threshold=0.5).logits.device.type == "meta"
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    without = {n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or p.grad.device.type != "meta")}
    # The `labels` loss is the last step's cross-entropy (the framework's `loss`): Ouro's exit head has no part in it.
    assert without == ({"model.exit_head.weight", "model.exit_head.bias"} if model.config.exit_head else set())


def test_inference_device_defaults_to_cuda_where_present_and_refuses_what_is_missing(monkeypatch):
    from grt_megatron.device import inference_device

    assert inference_device(None) == torch.device("cpu") and inference_device("cpu") == torch.device("cpu")
    for bad, reason in (("cuda", "CUDA is not available"), ("tpu", "not cpu, cuda or cuda:N"),
                        ("cuda:x", "not cpu, cuda or cuda:N"), ("meta", "not cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=reason):
            inference_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # Always with an index: torch.cuda.set_device(torch.device("cuda")) raises.
    assert inference_device(None) == inference_device("cuda") == torch.device("cuda", 0)
    assert inference_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="this machine has 2 CUDA device"):
        inference_device("cuda:2")


def test_hide_cuda_refuses_when_torch_already_saw_a_gpu(monkeypatch):
    from grt_megatron.device import hide_cuda

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    hide_cuda()  # no GPU here: hidden, nothing to refuse
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch had counted the GPUs already
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES= instead"):
        hide_cuda()


# ---- checkpoints across device kinds ------------------------------------------------------------------------
def test_rng_states_drawn_on_another_kind_of_device_are_not_set(world, tmp_path):
    """megatron's tracker holds CPU generator states here and CUDA Philox states (16 bytes) on a GPU; one
    cannot be set into the other, so a checkpoint resumed on the other kind of device is reseeded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from grt_megatron.checkpoint.rng import capture_rng, restore_rng, rng_fits_this_device

    here = tmp_path / "rng_here.safetensors"
    here.write_bytes(capture_rng())
    assert rng_fits_this_device(here)
    restore_rng(here)
    with safe_open(str(here), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    assert any(k.startswith("tracker/") for k in tensors)
    gpu = {k: (torch.zeros(16, dtype=torch.uint8) if k.startswith("tracker/") else v) for k, v in tensors.items()}
    written_on_a_gpu = tmp_path / "rng_gpu.safetensors"
    save_file(gpu, str(written_on_a_gpu), metadata=metadata)
    assert not rng_fits_this_device(written_on_a_gpu)
    with pytest.raises(RuntimeError):  # what resuming used to do: set them anyway, and fail at the first fork
        restore_rng(written_on_a_gpu)
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
    restore_rng(here)  # leave this process's tracker as it was


def test_load_weights_allows_only_transformer_engines_extra_state_to_be_missing(world):
    """Checkpoints hold parameters; Transformer Engine's layers also list `_extra_state` (FP8 metadata)."""
    from grt_megatron.checkpoint.consolidate import load_weights
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.model import GRTLanguageModel

    class WithExtraState(torch.nn.Module):  # what a TE module adds to the state dict
        def get_extra_state(self):
            return torch.zeros(0)

        def set_extra_state(self, state):
            pass

    source = GRTLanguageModel(_experiment_config("grt_isoflops", []), init_seed=1)
    tensors = {k: v.clone() for k, v in source.named_parameters()}
    model = GRTLanguageModel(_experiment_config("grt_isoflops", []), init_seed=2)
    model.final_norm.te_like = WithExtraState()
    assert "final_norm.te_like._extra_state" in model.state_dict()
    load_weights(model, tensors)
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())
    del tensors["final_norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing \['final_norm.weight'\], unexpected \[\]"):
        load_weights(model, tensors)
