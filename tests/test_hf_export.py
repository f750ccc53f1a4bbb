"""Hugging Face export and import with the real transformers: logits parity with the framework for
models trained in TP 2 and PP 2, the per-recurrence K/V cache, batching with left padding, the folder on
its own (project not importable), round trips, grt-generate."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, json_from_fresh_process, run_cli

QUIET = ["logging.wandb=disabled", "logging.progress=false"]
PORT = iter(range(29800, 29850))


@pytest.fixture(scope="module")
def trained(pydoc_prefix, tmp_path_factory):
    """A tiny GRT (1+2×3+1, so the core has two layers) trained 3 steps in TP 2 (with its own output layer)
    and in PP 2 (tied; bf16-mixed with an fp32 residual stream, a setting the checkpoint records). A small LR
    keeps the untied one close to its random init, whose greedy continuations vary from token to token (a
    tied random model repeats its input token)."""
    out = {}
    for name, layout in (("tp2", ["parallel.tp=2", "model.tie_embeddings=false"]),
                         ("pp2", ["parallel.pp=2", "deepspeed.zero_stage=1", "train.precision=bf16-mixed",
                                  "model.fp32_residual_connection=true"])):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        proc = run_cli(["model=tiny", "model.core_layers=2", "model.recurrences=3", f"data={pydoc_prefix[0]}",
                        "train.iters=3", "train.lr=1e-5", "train.min_lr=1e-6", "train.global_batch_size=4",
                        "train.micro_batch_size=2",
                        "train.eval_iters=1", *QUIET, *layout, f"run.dir={run_dir}"],
                       launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 f"--master_port={next(PORT)}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = run_dir / "checkpoints" / "step_00000003"
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from grt_megatron.hf.convert import export_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {name: export_checkpoint(ckpt, root / name, progress=False) for name, ckpt in trained.items()}


def _hf(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=dtype).eval()


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_exported_logits_equal_the_framework(world, trained, exported, layout):
    from grt_megatron.checkpoint.consolidate import consolidate
    from grt_megatron.checkpoint.store import inspect_checkpoint
    from grt_megatron.model import GRTConfig, GRTLanguageModel

    tensors, _ = consolidate(trained[layout], progress=False)
    framework = GRTLanguageModel(GRTConfig.from_recipe(inspect_checkpoint(trained[layout]).state["model"]))
    framework.load_state_dict(tensors, strict=True)
    framework.eval()
    tokens = torch.randint(0, 2048, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = framework(tokens)
        got = _hf(exported[layout])(tokens).logits
    assert got.shape == want.shape == (3, 40, 2048)
    assert (got - want).abs().max() <= 1e-4


def test_greedy_with_cache_equals_without_and_batches_equal_one_by_one(exported):
    model = _hf(exported["tp2"])
    prompt = torch.randint(3, 2048, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    cached = model.generate(prompt, **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 9:].tolist())) > 3  # a continuation that varies, not one token repeated
    # Left-padded batch == each prompt alone (positions count real tokens; padding is never attended).
    short = prompt[:, :5]
    pad = model.generation_config.pad_token_id
    batch = torch.cat([torch.cat([torch.full((1, 4), pad), short], 1), prompt])
    mask = torch.cat([torch.cat([torch.zeros(1, 4), torch.ones(1, 5)], 1), torch.ones(1, 9)]).long()
    together = model.generate(batch, attention_mask=mask, **kw)
    assert torch.equal(together[0, 9:], model.generate(short, **kw)[0, 5:])
    assert torch.equal(together[1, 9:], cached[0, 9:])


def test_recurrence_override_adaptive_exit_and_averaged_cache(exported):
    model = _hf(exported["tp2"])
    prompt = torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(prompt, use_cache=True)
    average = model(prompt, use_cache=True, kv_cache="average")
    # 1+2×3+1: 8 layer executions per token vs 4 slots (prelude, 2 core layers, coda).
    assert full.cache.nbytes() == 2 * average.cache.nbytes()
    assert torch.allclose(full.logits, average.logits, atol=1e-5)  # within one forward, no approximation
    assert average.cache.nbytes() / full.cache.nbytes() == 4 / 8
    deeper = model(prompt, num_recurrences=6, use_cache=True)
    assert len(deeper.cache.layers) == 1 + 2 * 6 + 1 and not torch.allclose(deeper.logits, full.logits)
    model(prompt, exit_threshold=10.0)  # every token exits after its first recurrence
    assert model.last_recurrences.eq(1).all()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert model.generate(prompt[:1], exit_threshold=10.0, **kw).shape == (1, 20)
    assert model.generate(prompt[:1], kv_cache="average", **kw).shape == (1, 20)


def test_folder_alone_loads_without_the_project(exported, tmp_path):
    """Copied elsewhere, with `grt_megatron` unimportable: AutoModel/AutoTokenizer (decoding keeps `</s>`),
    pipeline, bf16."""
    folder = tmp_path / "copy"
    shutil.copytree(exported["pp2"], folder)
    script = f"""
import sys
sys.modules["grt_megatron"] = None  # any import of the project now fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
tok = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
text = "def main():\\n    return 1"
ids, eos = tok.encode(text), tok.eos_token_id
assert tok.decode(ids) == text
# Special tokens are kept unless skip_special_tokens=True (sentencepiece alone would drop </s>).
assert tok.decode(ids + [eos] + ids, skip_special_tokens=False) == text + "</s>" + text
assert tok.decode(ids + [eos] + ids) == text + "</s>" + text
assert tok.decode(ids + [eos] + ids, skip_special_tokens=True) == text + " " + text
out = pipeline("text-generation", model=model, tokenizer=tok)(text, max_new_tokens=5, do_sample=False)
assert out[0]["generated_text"].startswith(text), out
bf16 = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.bfloat16)
ids = bf16.generate(torch.tensor([tok.encode(text)]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
assert ids.shape[1] == len(tok.encode(text)) + 5
print("ok", type(model).__module__)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok transformers_modules." in proc.stdout


def test_export_import_export_is_identical_and_imports_train(exported, pydoc_prefix, tmp_path):
    from grt_megatron.hf.convert import export_checkpoint, import_hf

    ckpt = import_hf(exported["tp2"], tmp_path / "imported" / "checkpoints" / "step_00000000", progress=False)
    again = export_checkpoint(ckpt, tmp_path / "again", max_shard_size="1MB", progress=False)
    assert len(json.loads((again / "model.safetensors.index.json").read_text())["weight_map"]) > 0  # sharded
    first = load_file(str(exported["tp2"] / "model.safetensors"))
    second = {}
    for shard in sorted(again.glob("model-*.safetensors")):
        second.update(load_file(str(shard)))
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype and torch.equal(first[name], second[name]), name
    assert json.loads((again / "config.json").read_text()) == json.loads((exported["tp2"] / "config.json").read_text())
    with pytest.raises(Exception, match="exists; refusing to overwrite"):
        export_checkpoint(ckpt, again, progress=False)
    # ... and the sharded folder imports to the same checkpoint tensors.
    from safetensors.torch import load_file as load

    twice = import_hf(again, tmp_path / "twice" / "checkpoints" / "step_00000000", progress=False)
    a, b = load(str(ckpt / "model-tp00-pp00.safetensors")), load(str(twice / "model-tp00-pp00.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The imported checkpoint fine-tunes in another layout (PP 2 here, saved as one process).
    proc = run_cli(["model=tiny", "model.core_layers=2", "model.recurrences=3", "model.tie_embeddings=false",
                    f"data={pydoc_prefix[0]}", "train.iters=2", "train.global_batch_size=4",
                    "train.micro_batch_size=2", "train.eval_iters=1",
                    "parallel.pp=2", "deepspeed.zero_stage=1", *QUIET, f"run.dir={tmp_path / 'ft'}", f"resume={ckpt}"],
                   launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={next(PORT)}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt} at step 0" in proc.stdout and "resharded, RNG states reseeded" in proc.stdout


def test_grt_generate_gives_the_same_tokens_from_checkpoint_and_export(trained, exported, capsys):
    # Not this test process's world of one (its port is taken): the CLI starts its own.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}

    def generate(*args):
        proc = subprocess.run([sys.executable, "-m", "grt_megatron.generation", *args, "--prompt", "def main",
                               "--max-new-tokens", "16", "--greedy"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    # A run directory, as resume= takes it: its newest complete checkpoint, named on stderr.
    from_run = generate("--checkpoint", str(trained["tp2"].parents[1]))
    from_checkpoint = from_run.stdout
    assert from_checkpoint == generate("--hf", str(exported["tp2"])).stdout
    assert from_checkpoint.startswith("def main") and len(set(from_checkpoint)) > 5
    assert f"grt-generate: using {trained['tp2']}\n" in from_run.stderr
    assert "grt-generate: fp32 on cpu\n" in from_run.stderr  # CUDA where present (none here), as grt-eval
    # bf16: it runs, says so, and warns where this CPU takes bf16's slow path. (The export in bf16 is
    # from_pretrained's dtype: its logits are checked in tools/gpu_check.py's hf_logits, CPU mode in CI.)
    bf16 = generate("--checkpoint", str(trained["tp2"]), "--device", "cpu", "--dtype", "bf16")
    assert bf16.stdout.startswith("def main") and "grt-generate: bf16 on cpu\n" in bf16.stderr

    # Refusals, in this process (each happens before a model is built).
    from grt_megatron.generation import main as grt_generate
    from grt_megatron.hf.convert import main as grt_convert_hf

    assert grt_generate(["--checkpoint", str(trained["tp2"]), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "grt-generate: error: --device cuda: CUDA is not available on this machine"]
    # A mistyped folder was read as a Hub repo id ("Repo id must be in the form ..."); a cut weights file
    # was a traceback.
    damaged = exported["tp2"].parent / "damaged"
    shutil.copytree(exported["tp2"], damaged)
    (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:100])
    for folder, message in ((exported["tp2"].parent / "nope", "no config.json (not an exported Hugging Face folder)"),
                            (damaged, "the model does not load: Error while deserializing header")):
        assert grt_generate(["--hf", str(folder), "--greedy"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grt-generate: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"grt-generate: error: --hf {folder}: {message}"), errors
    assert grt_convert_hf(["--checkpoint", str(REPO), "--output", str(exported["tp2"].parent / "x")]) == 2
    err = capsys.readouterr().err
    assert "grt-convert-hf: error:" in err and "not a grt-megatron checkpoint" in err


_CONVERT_IMPORTS = """
import json, sys
from grt_megatron.hf import convert

status = convert.main(sys.argv[1:])
print("CONVERT " + json.dumps([status, [m for m in ("transformers", "megatron") if m in sys.modules]]))
"""


@pytest.mark.parametrize("case", ["missing_checkpoint", "existing_output", "folder_without_config"])
def test_grt_convert_hf_checks_its_paths_before_the_heavy_imports(trained, exported, tmp_path, case):
    """A mistyped path fails in about a second: before transformers and megatron-core are imported."""
    args = {"missing_checkpoint": ["--checkpoint", str(tmp_path / "nothing"), "--output", str(tmp_path / "x")],
            "existing_output": ["--checkpoint", str(trained["tp2"]), "--output", str(exported["tp2"])],
            "folder_without_config": ["--from-hf", str(tmp_path), "--output", str(tmp_path / "ckpt")]}[case]
    status, imported = json_from_fresh_process(_CONVERT_IMPORTS, args, "CONVERT ", timeout=120)
    assert status == 2 and imported == []


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_grt_generate_loads_a_checkpoint_in_bf16_within_bf16s_rounding(world, trained, layout):
    """`grt-generate --dtype bf16` builds the framework model in bf16 (weights and activations) from any
    layout's checkpoint; its logits stay within the HF export's bf16 tolerance of fp32's. A checkpoint
    trained with an fp32 residual stream loads too (bf16 weights carry a bf16 stream; the training
    setting was refused with bf16 weights, a message about train.precision)."""
    from grt_megatron.generation import load_checkpoint_model

    tokens = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    fp32 = load_checkpoint_model(trained[layout], torch.device("cpu"), "fp32")
    bf16 = load_checkpoint_model(trained[layout], torch.device("cpu"), "bf16")
    assert fp32.config.fp32_residual_connection == (layout == "pp2")
    assert not fp32.training and {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        want, got = fp32(tokens), bf16(tokens).float()
    diff = float((got - want).abs().max())
    assert 0 < diff <= 2e-2 * max(1.0, float(want.abs().max()))


_EXPORT_WITH_FROZEN_IMPORTS = """
import gc, json, sys
from grt_megatron.hf import convert

status = convert.main(sys.argv[1:])
print("EXPORT " + json.dumps([status, gc.isenabled(), gc.get_freeze_count()]))
"""


def test_grt_convert_hf_freezes_its_imports_and_writes_the_same_folder(trained, exported, tmp_path):
    """grt-convert-hf imports transformers and the framework with the collector off and freezes them
    (console.import_frozen): its exit then skips ~1.5 s of collections; the folder is the same."""
    out = tmp_path / "hf"
    status, enabled, frozen = json_from_fresh_process(
        _EXPORT_WITH_FROZEN_IMPORTS, ["--checkpoint", str(trained["tp2"]), "--output", str(out)], "EXPORT ",
        timeout=300)
    assert status == 0 and enabled and frozen > 100_000
    got, want = load_file(str(out / "model.safetensors")), load_file(str(exported["tp2"] / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 1"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0 (or pass --greedy)"),
    (["--top-k", "-3"], "--top-k -3: must be >= 0 (0: no top-k)"),
    (["--num-recurrences", "0"], "--num-recurrences 0: must be >= 1"),
    (["--exit-threshold", "-1"], "--exit-threshold -1.0: must be > 0"),
    (["--kv-cache", "average"], "--kv-cache average: applies to --hf (a checkpoint's model has no cache)"),
])
def test_grt_generate_refuses_what_it_used_to_take_in_silence(tmp_path, capsys, args, message):
    """A temperature of 0 without --greedy decoded greedily, R = 0 ran the trained R, a negative top-k was
    a traceback: each is one line naming the flag, exit 2, before anything is loaded."""
    from grt_megatron.generation import main

    assert main(["--checkpoint", str(tmp_path), *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"grt-generate: error: {message}"]
