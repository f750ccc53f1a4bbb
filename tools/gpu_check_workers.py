"""The in-process measurements of tools/gpu_check.py, each run in a fresh process by it:

    python tools/gpu_check_workers.py step|hf|throughput --result OUT.json [options]

`step`: one fp32 AdamW step of the tiny GRT (weights, logits and losses to compare CPU with the device);
`hf`: the exported folder through transformers against the framework model (logits, cached generation);
`throughput`: median step time, FLOPs/s, MFU and peak memory of one model through the DeepSpeed engine.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.gpu_check_runner import write_json_atomically  # noqa: E402


# ---- workers ------------------------------------------------------------
def _quiet_imports():
    from grt_megatron.console import quiet_known_warnings

    quiet_known_warnings()


def _compose(overrides: list[str]):
    from grt_megatron.training.cli import compose_run_config

    return compose_run_config([*overrides, "run.dir=unused"])


def _tf32_off() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def worker_step(args) -> dict:
    """One fp32 AdamW step of the tiny GRT; weights, logits and losses for the comparison."""
    import torch

    from grt_megatron.distributed import init_distributed
    from grt_megatron.model import GRTLanguageModel

    info = init_distributed(seed=0)
    _tf32_off()  # after the set-up, so that nothing it does turns TF32 back on
    seq, batch, vocab = 64, 4, 1024
    run = _compose(["model=tiny", "model.noise_sigma=0", "model.depth_sampler=fixed",
                    f"model.max_sequence_length={seq}", "train.precision=fp32"])
    config = run.model_config(vocab)
    model = GRTLanguageModel(config, init_seed=0)  # built on CPU (use_cpu_initialization): same seed, same weights
    # Parameters, not the state dict: with Transformer Engine (the device's `auto` spec) it also holds each
    # layer's `_extra_state`, which the CPU side's local layers do not have.
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    model = model.to(info.device).train()
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(info.device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    r = config.recurrences
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    logits = model(x).detach()
    loss = model(x, y, r, r).mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    optimizer.step()
    with torch.no_grad():
        loss_after = model(x, y, r, r).mean()
    torch.save({"weights": weights, "logits": logits.float().cpu()}, args.tensors)
    device = torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"
    return {"device": device, "model": config.shape_name, "loss_before": float(loss), "loss_after": float(loss_after),
            "grad_norm": float(grad_norm)}


def worker_hf(args) -> dict:
    """The exported folder through transformers on the device, against the framework model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grt_megatron.checkpoint.consolidate import consolidate, load_weights
    from grt_megatron.checkpoint.store import inspect_checkpoint
    from grt_megatron.distributed import init_distributed
    from grt_megatron.model import GRTConfig, GRTLanguageModel

    info = init_distributed(seed=0)
    _tf32_off()
    checkpoint = Path(args.checkpoint)
    tensors, _ = consolidate(checkpoint, progress=False)
    recipe = inspect_checkpoint(checkpoint).state["model"]
    tokens = torch.randint(0, recipe["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(info.device)

    def hf_model(dtype):
        return AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True, dtype=dtype) \
            .to(info.device).eval()

    logits = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        framework = GRTLanguageModel(GRTConfig.from_recipe(recipe, precision=precision))
        load_weights(framework, tensors)
        framework = framework.to(info.device).eval()  # a bf16 model is bf16 throughout (language_model.py)
        with torch.no_grad():
            want = framework(tokens).float()
            got = hf_model(dtype)(tokens).logits.float()
        logits[precision] = {"max_abs_diff": float((got - want).abs().max()),
                             "max_abs_logit": float(want.abs().max()),
                             "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
                             "shape": list(got.shape)}
        del framework

    model = hf_model(torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir, trust_remote_code=True)
    prompt_text = "def main():\n    "
    prompt = torch.tensor([tokenizer.encode(prompt_text, add_special_tokens=False)], device=info.device)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
    new = cached.sequences[0, prompt.shape[1]:].tolist()
    # Scores hold -inf where min_new_tokens masks EOS: equal entries count as no difference.
    scores_diff = max(float(torch.where(a == b, 0.0, (a - b).abs()).max())
                      for a, b in zip(cached.scores, uncached.scores))
    generate = {"prompt": prompt_text, "new_tokens": len(new), "tokens_equal": torch.equal(cached.sequences,
                                                                                           uncached.sequences),
                "distinct_new_tokens": len(set(new)), "scores_max_abs_diff": scores_diff,
                "text": tokenizer.decode(new), "dtype": "fp32",
                "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"}
    return {"logits": logits, "generate": generate}


def worker_throughput(args) -> dict:
    """Median step time of one model through the DeepSpeed engine, measured by tools/bench/gpu_mfu.py."""
    from grt_megatron.distributed import init_distributed
    from tools.bench.gpu_mfu import measure_training_step

    init_distributed(seed=0)
    row = measure_training_step(args.model, args.batch, args.seq, args.timed_steps, args.warmup, args.precision,
                                vocab=args.vocab, compile=args.compile, accumulation=args.accumulation)
    return {**row, "warmup_steps": args.warmup, "timed_steps": args.timed_steps,
            "losses_finite": all(math.isfinite(v) for v in row["losses"])}


WORKERS = {"step": worker_step, "hf": worker_hf, "throughput": worker_throughput}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("worker", choices=sorted(WORKERS))
    parser.add_argument("--result", type=Path, required=True)
    for name, kind in (("--tensors", str), ("--checkpoint", str), ("--hf-dir", str), ("--model", str),
                       ("--seq", int), ("--batch", int), ("--warmup", int), ("--timed-steps", int), ("--vocab", int)):
        parser.add_argument(name, type=kind)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "bf16-mixed"))
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    _quiet_imports()
    write_json_atomically(args.result, WORKERS[args.worker](args))
    from grt_megatron.distributed import destroy_distributed

    destroy_distributed()  # else NCCL warns at exit, and that warning buries a failure's error line
    return 0


if __name__ == "__main__":
    sys.exit(main())
