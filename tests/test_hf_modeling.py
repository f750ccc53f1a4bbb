"""The exported model driven as transformers users drive it, each test in a fresh process on a copy of the
folder with the project unimportable: Trainer under gradient accumulation, the cache under both names and
unknown keywords, activation checkpointing, inputs_embeds / hidden states / tuples, PEFT (LoRA, prompt
tuning; prefix tuning refused), AutoModel, generation settings in GenerationConfig and a cache reused at
another depth, the learned-position limit; and grt-convert-hf on a run directory and on a folder without a
tokenizer."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import LAUNCHER_VARIABLES, REPO, run_cli

# An untied tiny GRT 1+2×3+1 (two core layers, so a recurrence spans several slots) with 32 learned positions,
# trained 2 steps at a small LR: close to its random init, whose greedy continuations vary.
SHAPE = ["model=tiny", "model.core_layers=2", "model.recurrences=3", "model.max_sequence_length=32",
         "model.tie_embeddings=false"]
P, K, R, C = 1, 2, 3, 1

PRELUDE = """
import sys
sys.modules["grt_megatron"] = None  # any import of the project now fails
import torch
from transformers import AutoModelForCausalLM

def load(**kw):
    return AutoModelForCausalLM.from_pretrained("copy", trust_remote_code=True, **kw)

def cache_of(out):  # the outputs' field: `cache` from transformers 5.24, `past_key_values` before
    return out.cache if hasattr(out, "cache") else out.past_key_values

def close(a, b, atol):
    return (a - b).abs().max().item() <= atol

ids = torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(0))
"""


@pytest.fixture(scope="module")
def run_dir(pydoc_prefix, tmp_path_factory):
    run = tmp_path_factory.mktemp("modeling") / "run"
    proc = run_cli([*SHAPE, f"data={pydoc_prefix[0]}", "train.iters=2", "train.lr=1e-5", "train.min_lr=1e-6",
                    "train.global_batch_size=4",
                    "train.micro_batch_size=2", "train.eval_iters=1", "logging.wandb=disabled",
                    "logging.progress=false", f"run.dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def folder(run_dir, tmp_path_factory):
    from grt_megatron.hf.convert import export_checkpoint

    return export_checkpoint(run_dir / "checkpoints" / "step_00000002", tmp_path_factory.mktemp("hf") / "grt",
                             progress=False)


def alone(folder, tmp_path, body: str) -> str:
    """Run PRELUDE + body next to a copy of the folder: clean PYTHONPATH, cwd outside the repo, own module cache."""
    shutil.copytree(folder, tmp_path / "copy")
    # Nor the launcher variables an in-process test of this pytest worker exported (its `world` holds
    # MASTER_PORT): accelerate would read them and start a process group on that taken port.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in LAUNCHER_VARIABLES}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")  # never shared with another test run's copies
    # GRT_HF_CLIENT_PYTHONPATH: another transformers to be the client (e.g. an older one installed with
    # `pip install --target`), to check that an export runs under the versions its users have.
    if os.environ.get("GRT_HF_CLIENT_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["GRT_HF_CLIENT_PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("ok"), proc.stdout[-2000:]
    return proc.stdout


def test_trainer_gradient_accumulation_equals_one_big_batch(folder, tmp_path):
    """Batch 4 × 1 and batch 2 × accumulation 2 see the same 8 rows (the sampler's order does not depend on
    the batch size) with 3..20 labelled tokens each: same losses, same weights after 2 Adam steps."""
    alone(folder, tmp_path, """
    import torch.nn.functional as F
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (20, 3, 11, 7, 16, 5, 9, 14):  # real tokens per row, right-padded with EOS and label -100
        x, real = torch.randint(3, 2048, (20,), generator=g), torch.arange(20) < n
        rows.append({"input_ids": torch.where(real, x, 1), "attention_mask": real.long(),
                     "labels": torch.where(real, x, -100)})

    def train(batch, accumulation):
        model = load()
        args = TrainingArguments(output_dir=f"out{batch}x{accumulation}", per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, max_steps=2, learning_rate=1e-3,
                                 lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        log = [h for h in trainer.state.log_history if "loss" in h]
        return [h["loss"] for h in log], [h["grad_norm"] for h in log], model.state_dict()

    start = load().state_dict()
    loss1, norm1, w1 = train(4, 1)
    loss2, norm2, w2 = train(2, 2)
    print(loss1, loss2, norm1, norm2)
    assert all(abs(a - b) <= 1e-6 * a for a, b in zip(loss1, loss2)), (loss1, loss2)
    assert all(abs(a - b) <= 1e-5 * a for a, b in zip(norm1, norm2)), (norm1, norm2)
    moved = max((w1[k] - start[k]).abs().max().item() for k in w1)
    apart = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    print("update", moved, "difference", apart)
    assert moved > 1e-3 and apart <= 1e-5, (moved, apart)

    # The rows' unequal counts matter: the mean of two micro-batch means is not the token mean.
    model = load()
    batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    with torch.no_grad():
        whole = model(**batch).loss
        halves = [model(**{k: v[i:i + 2] for k, v in batch.items()}).loss for i in (0, 2)]
        n = batch["labels"][:, 1:].ne(-100).sum()
        summed = [model(**{k: v[i:i + 2] for k, v in batch.items()}, num_items_in_batch=n).loss for i in (0, 2)]
    assert abs((halves[0] + halves[1]) / 2 - whole) > 1e-3
    assert abs(summed[0] + summed[1] - whole) <= 1e-5
    print("ok")
    """)


def test_cache_under_both_names_and_unknown_keywords_refused(folder, tmp_path):
    alone(folder, tmp_path, """
    model = load().eval()
    with torch.no_grad():
        full = model(ids).logits
        head = model(ids[:, :-3], use_cache=True)
        by_old_name = model(ids[:, -3:], past_key_values=cache_of(head)).logits
        head = model(ids[:, :-3], use_cache=True)
        by_new_name = model(ids[:, -3:], cache=cache_of(head)).logits
    assert by_old_name.shape == (2, 3, 2048)
    assert close(by_old_name, full[:, -3:], 1e-5) and close(by_new_name, full[:, -3:], 1e-5)
    for call in (lambda: model(ids, foo=1), lambda: model.model(ids, past_key_value=cache_of(head))):
        try:
            call()
            raise SystemExit("an unknown keyword was accepted")
        except TypeError as err:
            assert "'foo'" in str(err) or "'past_key_value'" in str(err), err
    try:
        model(ids, cache=cache_of(head), past_key_values=cache_of(head))
        raise SystemExit("two caches accepted")
    except ValueError as err:
        assert "not both" in str(err)
    print("ok")
    """)


def test_activation_checkpointing_gives_the_same_gradients(folder, tmp_path):
    alone(folder, tmp_path, f"""
    model = load().train()
    runs = [0]
    # A pre-hook: torch stops a recomputation once it has what backward needs, before forward hooks run.
    model.model.layers[{P + 1}].register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))

    def gradients():
        model.zero_grad()
        runs[0] = 0
        out = model(ids, labels=ids)
        out.loss.backward()
        return {{n: p.grad.clone() for n, p in model.named_parameters()}}, runs[0], cache_of(out)

    plain, plain_runs, _ = gradients()
    model.gradient_checkpointing_enable()
    assert model.model.gradient_checkpointing
    again, again_runs, cache = gradients()
    # The second core layer runs once per recurrence; checkpointed, each execution is recomputed in backward.
    assert (plain_runs, again_runs) == ({R}, {2 * R}), (plain_runs, again_runs)
    assert cache is None  # no cache while recomputing (it would be written twice)
    worst = max((plain[n] - again[n]).abs().max().item() for n in plain)
    print("largest gradient difference", worst)
    assert worst <= 1e-6 and all(plain[n].abs().sum() > 0 for n in plain)
    print("ok")
    """)


def test_inputs_embeds_hidden_states_tuples_and_attentions(folder, tmp_path):
    alone(folder, tmp_path, f"""
    model = load().eval()
    embeds = model.get_input_embeddings()(ids)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        assert torch.equal(model(inputs_embeds=embeds).logits, out.logits)
        by_ids = model.generate(ids[:1], **kw)
        by_embeds = model.generate(inputs_embeds=embeds[:1], **kw)  # returns the new tokens only
        assert torch.equal(by_embeds, by_ids[:, 12:]) and len(set(by_embeds[0].tolist())) > 2, (by_ids, by_embeds)
        # 1 + P + R + C: embeddings, prelude layer, each recurrence's state, coda layer (then the final norm).
        states = out.hidden_states
        assert len(states) == 1 + {P} + {R} + {C} and all(s.shape == (2, 12, 128) for s in states)
        positions = model.model.embed_positions(torch.arange(12))
        assert close(states[0], embeds + positions, 0)
        assert close(model.lm_head(states[-1]), out.logits, 1e-5)
        once = model(ids, num_recurrences=1, output_hidden_states=True).hidden_states
        assert len(once) == 1 + {P} + 1 + {C}
        assert close(once[1], states[1], 0) and close(once[2], states[2], 1e-6)  # recurrence 1 is recurrence 1
        assert not close(states[2], states[3], 1e-3)
        as_tuple = model(ids, labels=ids, return_dict=False)
        assert type(as_tuple) is tuple and len(as_tuple) == 3  # loss, logits, cache
        assert close(as_tuple[1], out.logits, 0) and as_tuple[0].ndim == 0
        assert type(model.model(ids, use_cache=False, return_dict=False)) is tuple
        try:
            model(ids, output_attentions=True)
            raise SystemExit("output_attentions accepted")
        except ValueError as err:
            assert "scaled_dot_product_attention" in str(err)
    print("ok")
    """)


def test_peft_lora_and_prompt_tuning_train_prefix_tuning_refused(folder, tmp_path):
    alone(folder, tmp_path, """
    from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, get_peft_model

    def fit(model, lr):
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt, losses = torch.optim.AdamW(trainable, lr=lr), []
        for _ in range(6):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    base = load()
    frozen = base.model.layers[1].self_attn.q_proj.weight.detach().clone()
    lora = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                           target_modules=["q_proj", "v_proj", "fc1", "fc2"]))
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    losses = fit(lora, 1e-2)
    print("lora", losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert torch.equal(base.model.layers[1].self_attn.q_proj.weight, frozen)  # only the adapters moved
    assert lora.generate(input_ids=ids[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, 16)

    # Adapters on the projection and the gate's first linear: those run whole on the concatenations, adapter
    # included (plain linears multiply h_pre's half once per forward): the merged model's logits.
    adapted = get_peft_model(load(), LoraConfig(r=2, target_modules=["injection", "gate_fc1"])).eval()
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))  # zero at creation
        got, before = adapted(input_ids=ids).logits, load().eval()(input_ids=ids).logits
        merged = adapted.merge_and_unload()(input_ids=ids).logits
    assert close(got, merged, 1e-4) and not close(got, before, 1e-2)

    plain = load().eval()
    prompted = get_peft_model(load(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    losses = fit(prompted, 1e-1)  # through inputs_embeds: 4 virtual tokens before each row
    print("prompt tuning", losses)
    assert losses[-1] < losses[0] - 0.05, losses
    prompted.eval()
    mask = torch.ones(1, 12, dtype=torch.long)
    with torch.no_grad():
        want = prompted(input_ids=ids[:1], attention_mask=mask).logits[:, -1]
        got = prompted.generate(input_ids=ids[:1], attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                                do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert close(got.logits[0], want, 1e-4) and not close(want, plain(ids[:1]).logits[:, -1], 1e-2)

    prefixed = get_peft_model(load(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    try:
        prefixed(input_ids=ids, labels=ids)
        raise SystemExit("prefix tuning accepted")
    except ValueError as err:
        assert "prefix tuning" in str(err) and "not supported" in str(err), err
    print("ok")
    """)


def test_auto_model_returns_the_hidden_states(folder, tmp_path):
    alone(folder, tmp_path, """
    from transformers import AutoModel

    base = AutoModel.from_pretrained("copy", trust_remote_code=True).eval()
    assert type(base).__name__ == "GRTModel"
    lm = load().eval()
    with torch.no_grad():
        hidden = base(ids).last_hidden_state
        assert hidden.shape == (2, 12, 128)
        assert close(lm.lm_head(hidden), lm(ids).logits, 1e-5)
    print("ok")
    """)


def test_generation_config_sets_recurrences_cache_and_exit(folder, tmp_path):
    saved = json.loads((folder / "generation_config.json").read_text())
    assert (saved["num_recurrences"], saved["kv_cache"], saved["exit_threshold"]) == (R, "per_recurrence", None)
    alone(folder, tmp_path, f"""
    from transformers import GenerationConfig

    model = load().eval()
    prompt = ids[:1]

    def logits(**kw):
        out = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kw)
        return torch.stack(out.logits), cache_of(out)

    def config(**kw):
        return GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                output_logits=True, **kw)

    with torch.no_grad():
        default, cache = logits()
        assert len(cache.layers) == {P + K * R + C}
        one, _ = logits(num_recurrences=1)
        out = model.generate(prompt, generation_config=config(num_recurrences=1))
        assert close(torch.stack(out.logits), one, 0) and not close(one, default, 1e-3)
        assert len(cache_of(out).layers) == {P + K + C}
        averaged, _ = logits(kv_cache="average")
        out = model.generate(prompt, generation_config=config(kv_cache="average"))
        assert close(torch.stack(out.logits), averaged, 0) and len(cache_of(out).layers) == {P + K + C}
        model.generate(prompt, generation_config=config(exit_threshold=10.0))
        assert model.last_recurrences.eq(1).all()
        model.generation_config.num_recurrences = 1  # the model's own generation config too
        assert close(logits()[0], one, 0)
        # A cache is laid out for one depth: another R is one clear error, not a shape error.
        try:
            model(prompt[:, -1:], cache=cache, num_recurrences=6)
            raise SystemExit("a cache of R={R} accepted at R=6")
        except ValueError as err:
            assert "this cache was built with num_recurrences={R}" in str(err) and "num_recurrences=6" in str(err)
    print("ok")
    """)


def test_generating_past_the_learned_positions_is_refused_up_front(folder, tmp_path):
    alone(folder, tmp_path, """
    model = load().eval()
    calls = [0]
    model.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    prompt = torch.randint(3, 2048, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        try:
            model.generate(prompt, max_new_tokens=5, do_sample=False)
            raise SystemExit("generated past 32 positions")
        except ValueError as err:
            assert "passes the 32 learned positions" in str(err) and "at most 2 new tokens" in str(err), err
        assert calls[0] == 0  # refused before any forward
        assert model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False).shape == (1, 32)
        assert model.generate(prompt, do_sample=False).shape[1] <= 32  # default length stops at the limit
        try:
            model(torch.randint(3, 2048, (1, 40)))
            raise SystemExit("40 tokens accepted")
        except ValueError as err:
            assert "position 39 is past the 32 learned positions" in str(err), err
    print("ok")
    """)


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "grt_megatron.hf.convert", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_convert_takes_a_run_directory_newest_complete_checkpoint(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    broken = run / "checkpoints" / "step_00000009"  # newer, but a file is truncated
    shutil.copytree(run / "checkpoints" / "step_00000002", broken)
    weights = next(broken.glob("model-*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    proc = _convert("--checkpoint", str(run), "--output", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping step_00000009" in proc.stdout
    assert f"exporting its newest complete checkpoint, {run / 'checkpoints' / 'step_00000002'}" in proc.stdout
    assert json.loads((tmp_path / "hf" / "grt_export.json").read_text())["step"] == 2


def test_convert_from_a_folder_without_tokenizer_is_one_line(folder, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    for name in ("tokenizer.model", "tokenizer_config.json", "tokenization_grt.py"):
        (bare / name).unlink()
    proc = _convert("--from-hf", str(bare), "--output", str(tmp_path / "ckpt" / "step_00000000"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("grt-convert-hf: error:")]
    assert errors == [f"grt-convert-hf: error: --from-hf {bare}: no tokenizer (tokenizer.model, or tokenizer.json / "
                      "tokenizer_config.json); a training checkpoint needs one: save it into the folder"], errors
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage,message", [
    ("config_not_json", "its config.json does not load: It looks like the config file at"),
    ("config_empty", "its config.json does not load: Unrecognized model in"),
    ("weights_truncated", "model.safetensors does not load (Error while deserializing header"),
    ("tokenizer_not_sentencepiece", "its tokenizer does not load:"),
    ("tokenizer_model_removed", "no tokenizer.model, which its tokenizer_config.json (custom code) reads"),
])
def test_importing_a_damaged_folder_is_one_line(folder, tmp_path, damage, message):
    """Each was a traceback, or (the export's custom tokenizer without its model file) transformers asking
    twice whether to run custom code before failing; none writes the checkpoint."""
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import import_hf

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    if damage == "config_not_json":
        (copy / "config.json").write_text((copy / "config.json").read_text()[:40])
    elif damage == "config_empty":
        (copy / "config.json").write_text("{}")
    elif damage == "weights_truncated":
        (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes()[:100])
    elif damage == "tokenizer_not_sentencepiece":
        (copy / "tokenizer.model").write_bytes(b"not a model")
    else:
        (copy / "tokenizer.model").unlink()
    with pytest.raises(CheckpointError) as refused:
        import_hf(copy, tmp_path / "ckpt" / "step_00000000", progress=False)
    assert str(refused.value).startswith(f"--from-hf {copy}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "ckpt").exists()


def test_export_refuses_a_bad_shard_size_and_an_output_under_a_file(tmp_path):
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import check_paths, check_shard_size

    for size in ("2GB", "500mb", "1.5 GB"):
        check_shard_size(size)
    for size in ("abc", "0GB", "1000", "-1GB"):
        with pytest.raises(CheckpointError, match="not a size such as 2GB or 500MB"):
            check_shard_size(size)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=r"afile is a file, not a folder"):
        check_paths(tmp_path / "afile" / "hf")
