"""Text from a model: plain sampling from a training model (no KV cache), and `grt-generate`.

    grt-generate --checkpoint runs/a/checkpoints/step_00000300 --prompt "def main" --max-new-tokens 40 --greedy
    grt-generate --checkpoint runs/a --prompt "def main"     # a run directory: its newest complete checkpoint
    grt-generate --hf hf/grt-tiny --prompt "def main" --max-new-tokens 40 --greedy [--num-recurrences 8]

`--checkpoint` runs grt-megatron's own model (any layout's checkpoint, merged into one process);
`--hf` runs the exported Hugging Face model with its per-recurrence K/V cache. Greedy, both give the same
tokens. Evaluation mode everywhere: noise off. Both run on `--device` (default: CUDA where available, as
grt-eval) in `--dtype` (default fp32). Greedy text does not depend on the device beyond rounding; sampled
text does, since each device has its own random number generator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from grt_megatron.data.tokenizer import Tokenizer
from grt_megatron.device import WEIGHT_DTYPES


@torch.no_grad()
def sample_text(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int = 0,
                device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int = 40,
                recurrences: Optional[int] = None) -> str:
    """`temperature` 0: greedy. `recurrences` overrides the model's R."""
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    window = model.config.max_sequence_length
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -window:], recurrences=recurrences)[:, -1, :].float()
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_id], dim=1)
    model.train(was_training)
    new = tokens[0, len(ids):].tolist() if prompt else tokens[0, 1:].tolist()
    return prompt + tokenizer.decode(new)


def load_checkpoint_model(path: Path, device: torch.device, dtype: str = "fp32"):
    """The framework model of checkpoint `path` (any layout's, merged into one process) in evaluation mode,
    on `device`, its weights in `dtype` (fp32 or bf16). The caller has started the process group (a world
    of one, `init_distributed`) on that device."""
    from grt_megatron.checkpoint.consolidate import consolidate, load_weights
    from grt_megatron.checkpoint.store import inspect_checkpoint
    from grt_megatron.model import GRTConfig, GRTLanguageModel

    tensors, _ = consolidate(path, progress=False)
    recipe = inspect_checkpoint(path).state["model"]
    if dtype == "bf16":  # a training setting for bf16-mixed: bf16 weights carry a bf16 stream (and refuse it)
        recipe = {**recipe, "fp32_residual_connection": False}
    # Built on the host (megatron's CPU initialisation) and moved whole, as DeepSpeed moves a training model.
    model = GRTLanguageModel(GRTConfig.from_recipe(recipe, precision="bf16" if dtype == "bf16" else "fp32"))
    load_weights(model, tensors)
    return model.to(device).eval()


def _from_checkpoint(args, device: torch.device) -> str:
    from grt_megatron.checkpoint.store import checkpoint_dir
    from grt_megatron.data.tokenizer import load_tokenizer
    from grt_megatron.distributed import destroy_distributed, init_distributed

    path, skipped = checkpoint_dir(args.checkpoint)  # a run directory: its newest complete checkpoint
    for s in skipped:
        print(f"grt-generate: skipping {s.path} ({s.problem})", file=sys.stderr)
    if path != Path(args.checkpoint):
        print(f"grt-generate: using {path}", file=sys.stderr)
    init_distributed(seed=args.seed)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # megatron's RoPE tables follow the current device, not the model's
        model = load_checkpoint_model(path, device, args.dtype)
        if args.exit_threshold is not None:
            if not 0 < args.exit_threshold <= 1:
                raise ValueError(f"--exit-threshold {args.exit_threshold}: must be in (0, 1]")
            if not model.config.exit_head:
                raise ValueError("--exit-threshold with --checkpoint needs an Ouro model (model.exit_head=true); "
                                 "a GRT's adaptive exit runs from its export (--hf)")
            # Ouro's exit rule: each token's logits come from the first step whose cumulative exit
            # probability reaches the threshold (every step still runs: nothing is cached here).
            model.config.exit_threshold, model.exit_rule = args.exit_threshold, "threshold"
        tokenizer = load_tokenizer(path / ("tokenizer.model" if (path / "tokenizer.model").is_file() else "tokenizer"))
        return sample_text(model, tokenizer, args.prompt, args.max_new_tokens, seed=args.seed, device=device,
                           temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k,
                           recurrences=args.num_recurrences)
    finally:
        destroy_distributed()


def _from_hf(args, device: torch.device) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors import SafetensorError

    from grt_megatron.errors import first_line

    if not (Path(args.hf) / "config.json").is_file():  # else transformers reads the path as a Hub repo id
        raise ValueError(f"--hf {args.hf}: no config.json (not an exported Hugging Face folder)")
    dtype = WEIGHT_DTYPES[args.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(args.hf, trust_remote_code=True, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as err:  # a truncated weights file, a broken config
        raise ValueError(f"--hf {args.hf}: the model does not load: "
                         f"{first_line(err)}") from None
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.hf, trust_remote_code=True)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False) if args.prompt else [tokenizer.eos_token_id]
    torch.manual_seed(args.seed)  # seeds every device's generator
    extra = {} if args.greedy else {"temperature": args.temperature, "top_k": args.top_k}
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens,
                         do_sample=not args.greedy, min_new_tokens=args.max_new_tokens,
                         num_recurrences=args.num_recurrences, kv_cache=args.kv_cache,
                         exit_threshold=args.exit_threshold, **extra)
    new = out[0, len(ids):].tolist()
    return args.prompt + tokenizer.decode(new, skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    from grt_megatron.console import import_frozen, quiet_known_warnings

    parser = argparse.ArgumentParser(prog="grt-generate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a training checkpoint directory (step_N), or a run "
                        "directory (its newest complete checkpoint)")
    source.add_argument("--hf", help="an exported Hugging Face folder")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--num-recurrences", type=int, default=None, help="R at inference (default: trained R)")
    parser.add_argument("--kv-cache", choices=("per_recurrence", "average"), default=None, help="--hf only")
    parser.add_argument("--exit-threshold", type=float, default=None,
                        help="a GRT's adaptive exit (--hf), or an Ouro model's exit rule (--hf or --checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(WEIGHT_DTYPES), default="fp32",
                        help="the weights' and activations' dtype")
    args = parser.parse_args(argv)
    # Values the model would take in silence (a temperature of 0 decoding greedily, R = 0 the trained R) or
    # refuse with a traceback: refused here, with the flag's name.
    problems = [f"{flag} {value}: {rule}" for flag, value, ok, rule in (
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "must be >= 1"),
        ("--temperature", args.temperature, args.greedy or args.temperature > 0, "must be > 0 (or pass --greedy)"),
        ("--top-k", args.top_k, args.top_k >= 0, "must be >= 0 (0: no top-k)"),
        ("--num-recurrences", args.num_recurrences, args.num_recurrences is None or args.num_recurrences >= 1,
         "must be >= 1"),
        ("--exit-threshold", args.exit_threshold, args.exit_threshold is None or args.exit_threshold > 0,
         "must be > 0"),
        ("--kv-cache", args.kv_cache, args.kv_cache is None or args.hf is not None,
         "applies to --hf (a checkpoint's model has no cache)"))
        if not ok]
    if problems:
        print(f"grt-generate: error: {problems[0]}", file=sys.stderr)
        return 2
    from grt_megatron.device import cpu_has_fast_bf16_matmuls, hide_cuda, inference_device

    try:
        device = inference_device(args.device)
        if args.checkpoint and device.type == "cpu" and args.device is not None:
            hide_cuda()  # megatron's layers would otherwise take GPU kernels for this CPU model
    except (ValueError, RuntimeError) as err:
        print(f"grt-generate: error: {err}", file=sys.stderr)
        return 2
    print(f"grt-generate: {args.dtype} on {device}", file=sys.stderr)
    if device.type == "cpu" and args.dtype == "bf16" and not cpu_has_fast_bf16_matmuls():
        print("grt-generate: warning: bf16 matmuls take a slow path on a CPU without AVX-512 (--dtype fp32 is "
              "faster here)", file=sys.stderr)
    quiet_known_warnings()
    import_frozen("grt_megatron.model" if args.checkpoint else "transformers")
    from grt_megatron.checkpoint.store import CheckpointError

    try:
        text = _from_checkpoint(args, device) if args.checkpoint else _from_hf(args, device)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"grt-generate: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
