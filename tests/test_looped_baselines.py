"""Ouro (looped LM with a learned exit) and RRT (per-recursion LoRA) as configurations of the one model:
forward/backward, closed-form parameter counts, Ouro's exit distribution and loss against a direct
computation, RRT at zero LoRA against the plain shared core, and the SVD initialisation from a dense model."""


import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, SHAKESPEARE, tiny_config
from hydra import compose, initialize_config_dir

from grt_megatron.model import ConfigError, GRTConfig, GRTLanguageModel, count_parameters, forward_flops_per_token
from grt_megatron.model.ouro import exit_log_probs, exit_steps, recording_exit_stats
from grt_megatron.model.relaxed import relax_dense_state

PLAIN = dict(gate="none", injection="none", noise_sigma=0.0, depth_sampler="fixed")
OURO = dict(PLAIN, exit_head=True, prelude_layers=0, core_layers=2, coda_layers=0, recurrences=3)
RRT = dict(PLAIN, lora_rank=4, recurrences=3)


def _tokens(vocab, seed=0, batch=2, length=17):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _grads_finite_and_nonzero(model, loss, names):
    loss.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for name in names:
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant", ["ouro", "rrt"])
def test_recipes_build_train_and_count_in_closed_form(world, variant):
    """The CPU grid's recipes build, run forward/backward, and count parameters and FLOPs in closed form."""
    from grt_megatron.training.config import build_run_config

    for comparison in ("isoflops", "isoparams"):
        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
            cfg = build_run_config(compose("train", overrides=[f"experiment=cpu/{variant}_{comparison}",
                                                              "run.dir=unused"]))
        config = cfg.model_config(300)
        model = GRTLanguageModel(config)
        counts = count_parameters(config)
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        if variant == "rrt":
            d, f, r, k = config.hidden_size, config.ffn_hidden_size, config.recurrences, config.core_layers
            assert counts["lora"] == r * k * config.lora_rank * (4 * d + 2 * d + (d + f) + (f + d)) > 0
            assert counts["lora"] == sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
        else:
            assert counts["exit_head"] == config.hidden_size + 1
            # Every step runs the LM head in training: R output layers in the forward FLOPs.
            flops = forward_flops_per_token(config, 16)
            assert flops["output_layer"] == config.recurrences * 2 * config.hidden_size * config.padded_vocab_size
    # The isoFLOPs cell executes the dense model's 6 layers.
    assert config.depth() in (18, 24)  # the isoparams cells: 1+4x4+1 (RRT), 0+6x4+0 (Ouro)
    small = tiny_config(**(OURO if variant == "ouro" else RRT))
    model = GRTLanguageModel(small).train()
    tokens = _tokens(small.vocab_size)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    _grads_finite_and_nonzero(model, loss, ["exit_head.weight"] if variant == "ouro"
                              else ["block.lora.layers.0.linear_qkv.b", "block.lora.layers.0.linear_fc2.b"])


# ---- Ouro ----------------------------------------------------------------------------------------------------
def test_ouro_exit_distribution_sums_to_one_and_the_last_step_takes_the_rest():
    logits = torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(0)) * 3
    p = exit_log_probs(logits).exp()
    torch.testing.assert_close(p.sum(0), torch.ones(3, 7), atol=1e-6, rtol=0)
    lam = torch.sigmoid(logits)
    survive = torch.ones(3, 7)
    for t in range(4):  # p_t = lambda_t * prod_{j<t} (1 - lambda_j)
        torch.testing.assert_close(p[t], lam[t] * survive, atol=1e-6, rtol=1e-5)
        survive = survive * (1 - lam[t])
    torch.testing.assert_close(p[4], survive, atol=1e-6, rtol=1e-5)  # the rest, not lambda_5 * survive
    # The exit step: the first step whose cumulative probability reaches the threshold; 1.0: the last step.
    steps = exit_steps(exit_log_probs(logits), 0.5)
    cdf = p.cumsum(0)
    for b in range(3):
        for s in range(7):
            t = int(steps[b, s])
            assert cdf[t, b, s] >= 0.5 and (t == 0 or cdf[t - 1, b, s] < 0.5)
    assert (exit_steps(exit_log_probs(logits), 1.0) == 4).all()


def test_ouro_loss_equals_a_direct_computation(world):
    config = tiny_config(**OURO, exit_entropy_coeff=0.05)
    model = GRTLanguageModel(config, init_seed=3).train()
    tokens = _tokens(config.vocab_size, seed=1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = model(inputs, labels)
    # Directly: run the shared stack step by step, full logits and torch's cross-entropy at every step.
    with torch.no_grad():
        h = model.embed(inputs)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
        ces, lams = [], []
        for _ in range(config.recurrences):
            for layer in model.block.core:
                h, _ = layer(h, attention_mask=mask)
            y = model.final_norm(h)
            logits = model.logits(y).transpose(0, 1)  # [b, s, V]
            ces.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       reduction="none").view(labels.shape))
            lams.append(torch.sigmoid(model.exit_head(y).squeeze(-1).transpose(0, 1)))
        p, survive = [], torch.ones_like(lams[0])
        for t, lam in enumerate(lams):
            p.append(lam * survive if t < len(lams) - 1 else survive)
            survive = survive * (1 - lam)
        p = torch.stack(p)
        entropy = -(p * p.log()).sum(0)
        want = (p * torch.stack(ces)).sum(0) - 0.05 * entropy
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-5)
    # Evaluation: the last step's CE (a fixed R), and each token's exit step's CE under the exit rule.
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(inputs, labels), ces[-1], rtol=1e-5, atol=1e-5)
        with recording_exit_stats(model, torch.device("cpu")) as stats:
            by_rule = model(inputs, labels)
        steps = exit_steps(p.log(), config.exit_threshold)
        torch.testing.assert_close(by_rule, torch.stack(ces).gather(0, steps[None])[0], rtol=1e-5, atol=1e-5)
        assert stats.tokens == labels.numel() and stats.exits.sum() == labels.numel()
        torch.testing.assert_close(stats.probability.float(), p.sum((1, 2)), rtol=1e-5, atol=1e-4)
        # Logits under the exit rule are those of each token's exit step.
        model.exit_rule = "threshold"
        logits = model(inputs)
        model.exit_rule = "last"
        assert logits.shape == (2, 16, config.vocab_size)


def test_ouro_keeps_one_steps_logits_at_a_time(world):
    """Autograd holds no [s, b, V] tensor of any step: each step's cross-entropy is recomputed in backward."""
    config = tiny_config(**{**OURO, "recurrences": 4})
    model = GRTLanguageModel(config).train()
    tokens = _tokens(config.vocab_size)
    vocab_sized = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == config.padded_vocab_size and t.shape[-2] != config.hidden_size:
            vocab_sized.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    assert vocab_sized == []
    loss.backward()  # and the recompute gives gradients
    assert model.exit_head.weight.grad.abs().sum() > 0


def test_ouro_and_rrt_refuse_what_they_do_not_support():
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.hf.convert import hf_config_kwargs
    from grt_megatron.parallel import validate_layout

    with pytest.raises(ConfigError, match="exit_head=true .Ouro. needs model.gate='none'"):
        tiny_config(**{**OURO, "gate": "mlp"})
    with pytest.raises(ConfigError, match="exit_threshold must be in"):
        tiny_config(**OURO, exit_threshold=0.0)
    with pytest.raises(ConfigError, match="lora_rank must be >= 0"):
        tiny_config(lora_rank=-1)
    with pytest.raises(ConfigError, match="cannot be combined with model.routing"):
        tiny_config(**PLAIN, lora_rank=2, routing="expert_choice")
    for fields in (OURO, RRT):
        with pytest.raises(ConfigError, match="not supported with tensor, sequence or pipeline parallelism"):
            GRTConfig.from_recipe(tiny_config(**fields).to_dict(), tensor_model_parallel_size=2)
        with pytest.raises(ConfigError, match="not supported with tensor, sequence or pipeline parallelism"):
            validate_layout(world_size=2, tp=1, pp=2, sp=False, zero_stage=1,
                            model={**fields, "hidden_size": 64}, seq_length=16, micro_batch=1, global_batch=2)
    # Both export (tests below); only an Ouro with a coda, which would need a cache slot per step, is refused.
    assert hf_config_kwargs(tiny_config(**OURO).to_dict())["exit_head"] is True
    assert hf_config_kwargs(tiny_config(**RRT).to_dict())["lora_rank"] == 4
    with pytest.raises(CheckpointError, match=r"exit_head=true \(Ouro\) with model.coda_layers=1"):
        hf_config_kwargs(tiny_config(**{**OURO, "coda_layers": 1}).to_dict())


# ---- RRT -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["none", "mlp"])
def test_rrt_with_zero_lora_is_the_plain_shared_core_bit_for_bit(world, gate):
    fields = dict(gate=gate, injection="none" if gate == "none" else "concat_project", noise_sigma=0.0,
                  depth_sampler="fixed", recurrences=3)
    relaxed = GRTLanguageModel(tiny_config(**fields, lora_rank=4), init_seed=5).train()
    plain = GRTLanguageModel(tiny_config(**fields), init_seed=5).train()
    shared = dict(plain.named_parameters())
    # The LoRA is its own initialisation piece: every shared weight is the plain model's.
    for name, p in relaxed.named_parameters():
        if ".lora." not in name:
            assert torch.equal(p, shared[name]), name
    tokens = _tokens(300, seed=2)
    got, want = relaxed(tokens[:, :-1], tokens[:, 1:]), plain(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(got, want)
    got.mean().backward()
    want.mean().backward()
    for name, p in plain.named_parameters():
        assert torch.equal(dict(relaxed.named_parameters())[name].grad, p.grad), name


def test_rrt_runs_each_recursions_delta_and_reuses_the_last_past_r(world):
    config = tiny_config(**RRT)
    model = GRTLanguageModel(config, init_seed=1).eval()
    with torch.no_grad():
        for lora in model.block.lora.modules():
            if hasattr(lora, "b"):
                lora.b.normal_(0, 0.05)
    tokens = _tokens(300)[:, :-1]
    with torch.no_grad():
        base = model(tokens, recurrences=4)
        # Recursion 4 (past the trained 3) reuses recursion 3's delta: zeroing it changes R = 4's output ...
        for lora in model.block.lora.modules():
            if hasattr(lora, "b"):
                lora.b[2].zero_()
        assert not torch.allclose(model(tokens, recurrences=4), base)
        # ... while zeroing recursion 1's changes R = 1's and R = 2's.
        before = model(tokens, recurrences=1)
        for lora in model.block.lora.modules():
            if hasattr(lora, "b"):
                lora.b[0].zero_()
        assert not torch.allclose(model(tokens, recurrences=1), before)


def test_rrt_svd_initialisation_reproduces_the_dense_layers_at_full_rank(world):
    dense = GRTLanguageModel(tiny_config(gate="none", injection="none", noise_sigma=0.0, depth_sampler="fixed",
                                         prelude_layers=0, core_layers=6, coda_layers=0, recurrences=1),
                             init_seed=7).eval()
    state = {k: v.detach().clone() for k, v in dense.state_dict().items() if v is not None}
    d = 64
    # 1+2x2+1: dense layers 1, 3 tie into core layer 0 and 2, 4 into core layer 1.
    # Rank d is full rank for every core linear (the smaller side of d x d, 3d x d, 4d x d, d x 4d).
    config = tiny_config(**PLAIN, prelude_layers=1, core_layers=2, recurrences=2, coda_layers=1, lora_rank=d)
    relaxed = relax_dense_state(state, prelude=1, core=2, recurrences=2, coda=1, rank=d)
    rrt = GRTLanguageModel(config).eval()
    missing, unexpected = rrt.load_state_dict(relaxed, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing)
    torch.testing.assert_close(relaxed["block.layers.1.mlp.linear_fc1.weight"],
                               (state["block.layers.1.mlp.linear_fc1.weight"]
                                + state["block.layers.3.mlp.linear_fc1.weight"]) / 2)
    tokens = _tokens(300, seed=4)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(rrt(tokens), dense(tokens), rtol=1e-4, atol=1e-4)
        # At a lower rank it is an approximation: close, not equal.
        low = GRTLanguageModel(tiny_config(**{**PLAIN, "prelude_layers": 1, "core_layers": 2, "recurrences": 2,
                                              "coda_layers": 1, "lora_rank": 8})).eval()
        low.load_state_dict(relax_dense_state(state, prelude=1, core=2, recurrences=2, coda=1, rank=8), strict=False)
        gap = (low(tokens) - dense(tokens)).abs().max()
        assert 1e-4 < gap < 10
    with pytest.raises(ValueError, match=r"has 6 layers; relaxing into 1\+1x2\+1 needs 4"):
        relax_dense_state(state, prelude=1, core=1, recurrences=2, coda=1, rank=4)


def test_grt_ckpt_relax_writes_a_checkpoint_that_reproduces_the_dense_model(world, tmp_path):
    from grt_megatron.checkpoint.cli import main as ckpt_main
    from grt_megatron.checkpoint.consolidate import consolidate, write_weights_checkpoint
    from grt_megatron.checkpoint.store import inspect_checkpoint
    from grt_megatron.data import SentencePieceTokenizer, load_documents

    dense_config = tiny_config(gate="none", injection="none", noise_sigma=0.0, depth_sampler="fixed",
                               prelude_layers=0, core_layers=4, coda_layers=0, recurrences=1)
    dense = GRTLanguageModel(dense_config, init_seed=9).eval()
    tokenizer = SentencePieceTokenizer.train(load_documents(str(SHAKESPEARE)), vocab_size=400)
    source = write_weights_checkpoint(tmp_path / "dense/checkpoints/step_00000000",
                                      {k: v for k, v in dense.state_dict().items() if "_extra_state" not in k},
                                      dense_config.to_dict(), tokenizer, reason="test", progress=False)
    out = tmp_path / "rrt/checkpoints/step_00000000"
    # Rank d = 64 is every core linear's full rank (the smaller side of d x d ... 4d x d): exact. Above it a
    # delta only costs memory (rank 100,000 at d 128 wrote 3.2 GB): refused, as a shape with R = 0.
    for shape, rank in (("1+1x2+1", "65"), ("1+1x0+3", "8")):
        assert ckpt_main(["relax", str(tmp_path / "dense"), "--shape", shape, "--lora-rank", rank,
                          "--output", str(out)]) == 2
        assert not out.exists()
    assert ckpt_main(["relax", str(tmp_path / "dense"), "--shape", "1+1x2+1", "--lora-rank", "64",
                      "--output", str(out)]) == 0
    state = inspect_checkpoint(out).state
    assert state["model"]["lora_rank"] == 64 and state["model_shape"] == "1+1x2+1"
    tensors, _ = consolidate(out, progress=False)
    rrt = GRTLanguageModel(GRTConfig.from_recipe(state["model"])).eval()
    rrt.load_state_dict(tensors, strict=False)
    tokens = _tokens(300, seed=4)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(rrt(tokens), dense(tokens), rtol=1e-4, atol=1e-4)
    assert ckpt_main(["relax", str(source), "--shape", "1+1x3+1", "--lora-rank", "2", "--output",
                      str(tmp_path / "x/step_00000000")]) == 2  # 5 layers != 4: one line, nothing written
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())



def test_rrt_exports_to_hugging_face_with_its_deltas_and_imports_back(world, tmp_path):
    """RRT's per-recursion deltas travel to the HF model as factors: logits equal the framework's at the trained
    R and past it (the last delta reused), greedy generation with the per-recursion cache equals generation
    without it, and the import gives back the very tensors."""
    from transformers import AutoModelForCausalLM

    from grt_megatron.checkpoint.consolidate import consolidate, write_weights_checkpoint
    from grt_megatron.data import SentencePieceTokenizer, load_documents
    from grt_megatron.hf.convert import export_checkpoint, import_hf

    config = tiny_config(lora_rank=4, prelude_layers=1, core_layers=2, coda_layers=1, recurrences=3)
    model = GRTLanguageModel(config, init_seed=3).eval()
    with torch.no_grad():
        for lora in model.block.lora.modules():
            if hasattr(lora, "b"):
                lora.b.normal_(0, 0.05)
    plain = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    tokenizer = SentencePieceTokenizer.train(load_documents(str(SHAKESPEARE)), vocab_size=400)
    ckpt = write_weights_checkpoint(tmp_path / "rrt/checkpoints/step_00000000", plain, config.to_dict(), tokenizer,
                                    reason="test", progress=False)
    folder = export_checkpoint(ckpt, tmp_path / "hf", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    assert hf.config.lora_rank == 4
    assert hf.model.layers[1].self_attn.q_proj.recursion_b.shape == (3, 64, 4)
    assert hf.model.layers[0].self_attn.q_proj.recursion_a is None  # the prelude is not relaxed
    tokens = _tokens(300, seed=2)[:, :-1]
    with torch.no_grad():
        for r in (3, 5):
            want = model(tokens, recurrences=r)
            assert (hf(tokens, num_recurrences=r).logits - want).abs().max() <= 1e-4, r
        # The deltas matter: without them the output is another.
        for module in hf.modules():
            if getattr(module, "recursion_b", None) is not None:
                module.recursion_b.zero_()
        assert (hf(tokens).logits - model(tokens)).abs().max() > 1e-3
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    prompt = tokens[:1, :6]
    cached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    uncached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    # A PEFT LoRA on top wraps the relaxed linears, passes the recursion through and trains only its adapters.
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(hf, LoraConfig(r=2, target_modules=["q_proj", "fc2"]))
    assert {n for n, p in peft.named_parameters() if p.requires_grad} == {
        n for n, _ in peft.named_parameters() if ".lora_A." in n or ".lora_B." in n} != set()
    peft(tokens, labels=tokens).loss.backward()
    with torch.no_grad():
        assert (peft(tokens).logits - model(tokens)).abs().max() <= 1e-4  # PEFT's B starts at zero

    back = import_hf(folder, tmp_path / "back/checkpoints/step_00000000", progress=False)
    tensors, _ = consolidate(back, progress=False)
    for name in ("block.lora.layers.1.linear_qkv.a", "block.lora.layers.1.linear_qkv.b",
                 "block.lora.layers.0.linear_fc2.b", "block.layers.1.self_attention.linear_qkv.weight"):
        assert torch.equal(tensors[name], plain[name]), name
    assert {k for k in tensors if ".lora." in k} == {k for k in plain if ".lora." in k}


def test_ouro_exports_to_hugging_face_with_its_exit_head_and_exit_rule(world, tmp_path):
    """An Ouro export gives the framework's logits at the last step and, with `exit_threshold`, under the exit
    rule (tokens exiting at different steps); cached and uncached greedy generation under the rule agree; the
    import gives back the exit head. An Ouro model with a coda is refused with one line."""
    from transformers import AutoModelForCausalLM

    from grt_megatron.checkpoint.consolidate import consolidate, write_weights_checkpoint
    from grt_megatron.checkpoint.store import CheckpointError
    from grt_megatron.data import SentencePieceTokenizer, load_documents
    from grt_megatron.hf.convert import export_checkpoint, hf_config_kwargs, import_hf

    config = tiny_config(**OURO)
    model = GRTLanguageModel(config, init_seed=3).eval()
    with torch.no_grad():  # spread the exits over the steps
        model.exit_head.weight.normal_(0, 0.3)
    plain = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    tokenizer = SentencePieceTokenizer.train(load_documents(str(SHAKESPEARE)), vocab_size=400)
    ckpt = write_weights_checkpoint(tmp_path / "ouro/checkpoints/step_00000000", plain, config.to_dict(), tokenizer,
                                    reason="test", progress=False)
    folder = export_checkpoint(ckpt, tmp_path / "hf", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    assert hf.config.exit_head and hf.config.exit_rule_threshold == 0.5 and hf.config.exit_threshold is None
    tokens = _tokens(300, seed=2, batch=4, length=17)[:, :-1]
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max() <= 1e-4
        assert (hf.last_recurrences == 3).all()
        model.exit_rule = "threshold"
        want = model(tokens)
        got = hf(tokens, exit_threshold=0.5).logits
        assert (got - want).abs().max() <= 1e-4
        steps = hf.last_recurrences
        assert len(steps.unique()) >= 2, steps.unique()  # the rule really chose among steps
        assert (got - hf(tokens).logits).abs().max() > 1e-3
    prompt = tokens[:1, :6]
    cached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, exit_threshold=0.5)
    uncached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, exit_threshold=0.5)
    assert torch.equal(cached, uncached)
    with pytest.raises(ValueError, match=r"exit rule takes a probability in \(0, 1\]"):
        hf(tokens, exit_threshold=1.5)

    back = import_hf(folder, tmp_path / "back/checkpoints/step_00000000", progress=False)
    tensors, _ = consolidate(back, progress=False)
    for name in ("exit_head.weight", "exit_head.bias", "block.layers.1.mlp.linear_fc1.weight"):
        assert torch.equal(tensors[name], plain[name]), name
    with pytest.raises(CheckpointError, match="coda_layers=1 is not supported by the Hugging Face export"):
        hf_config_kwargs(tiny_config(**{**OURO, "coda_layers": 1}).to_dict())
