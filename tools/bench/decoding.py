"""Decoding with the exported Hugging Face model: per-token latency and K/V-cache memory, GRT vs dense at
iso-FLOPs and iso-params, with the per-recurrence cache and with K/V averaging; plus the analytic peak
decode memory (weights + cache) of the paper's large shapes.

    python tools/bench/decoding.py [--width 256] [--new-tokens 48] [--compile]

Measured shapes are the small ones scaled to `--width` (random weights: latency does not depend on them):
GRT 1+1×10+1, dense 12 layers (iso-FLOPs) and dense 3 layers (iso-params, as many unique layers).
Targets: latency ≤ 1.15× dense at iso-FLOPs; averaging cuts the cache ≥ 2×.
Prints tables and writes tools/bench/results/decoding.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import argument_parser, parse_args, stamp, write_result  # noqa: E402

import torch  # noqa: E402

from grt_megatron.hf.configuration_grt import GRTConfig  # noqa: E402
from grt_megatron.hf.modeling_grt import GRTForCausalLM  # noqa: E402

VOCAB = 50304


def shapes(width: int) -> dict:
    common = dict(hidden_size=width, num_attention_heads=max(1, width // 64), ffn_hidden_size=4 * width,
                  vocab_size=VOCAB, max_position_embeddings=1024, eos_token_id=0, pad_token_id=0)
    dense = dict(prelude_layers=0, coda_layers=0, num_recurrences=1, gate="none", injection="none")
    return {"grt 1+1x10+1": GRTConfig(prelude_layers=1, core_layers=1, coda_layers=1, num_recurrences=10, **common),
            "dense 12 (iso-FLOPs)": GRTConfig(core_layers=12, **dense, **common),
            "dense 3 (iso-params)": GRTConfig(core_layers=3, **dense, **common)}


@torch.no_grad()
def decode(model, prompt, new_tokens: int, kv_cache: str, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             kv_cache=kv_cache)
        times.append(time.perf_counter() - start)
    cache = model(out, use_cache=True, kv_cache=kv_cache).cache.nbytes()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"ms_per_token": 1e3 * statistics.median(times) / new_tokens, "cache_bytes": cache,
            "weights_bytes": weights, "tokens": int(out.shape[1])}


def analytic_large(context: int, bytes_per_value: int = 2) -> dict:
    """Weights + K/V cache at `context` tokens, batch 1, bf16, for the paper's large shapes."""
    from grt_megatron.model import GRTConfig as TrainConfig
    from grt_megatron.model import count_parameters

    out = {}
    for name, (p, k, r, c) in {"large GRT isoFLOPs 1+5x6+5": (1, 5, 6, 5), "large dense 36": (0, 36, 1, 0)}.items():
        cfg = TrainConfig.from_recipe(dict(hidden_size=1280, num_attention_heads=20, vocab_size=50257,
                                           prelude_layers=p, core_layers=k, recurrences=r, coda_layers=c,
                                           **({} if r > 1 else dict(gate="none", injection="none"))))
        weights = count_parameters(cfg)["total"] * bytes_per_value
        per_slot = 2 * cfg.hidden_size * context * bytes_per_value
        out[name] = {"weights_mb": weights / 1e6, "cache_full_mb": (p + k * r + c) * per_slot / 1e6,
                     "cache_average_mb": (p + k + c) * per_slot / 1e6}
        out[name]["peak_full_mb"] = out[name]["weights_mb"] + out[name]["cache_full_mb"]
        out[name]["peak_average_mb"] = out[name]["weights_mb"] + out[name]["cache_average_mb"]
    return out


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd models")
    parser.add_argument("--context", type=int, default=1024, help="context for the analytic large-shape memory")
    args = parse_args(parser, "decoding")
    torch.manual_seed(0)
    prompt = torch.randint(1, VOCAB, (1, args.prompt))
    rows = []
    modes = ["eager"] + (["compiled"] if args.compile else [])
    for name, config in shapes(args.width).items():
        model = GRTForCausalLM(config).eval()
        for mode in modes:
            runner = model
            if mode == "compiled":
                runner.forward = torch.compile(model.forward, dynamic=True)
            caches = ("per_recurrence", "average") if config.num_recurrences > 1 else ("per_recurrence",)
            for kv in caches:
                decode(runner, prompt, 4, kv, 1)  # warm-up
                rows.append({"model": name, "mode": mode, "kv_cache": kv,
                             **decode(runner, prompt, args.new_tokens, kv, args.repeats)})
    print(f"decoding, d {args.width}, vocab {VOCAB}, prompt {args.prompt} + {args.new_tokens} new tokens, batch 1, "
          f"fp32, CPU ({torch.get_num_threads()} threads)")
    print(f"{'model':<22}{'mode':<10}{'cache':<16}{'ms/token':>10}{'cache MiB':>11}")
    for r in rows:
        print(f"{r['model']:<22}{r['mode']:<10}{r['kv_cache']:<16}{r['ms_per_token']:>10.2f}"
              f"{r['cache_bytes'] / 2**20:>11.2f}")

    def pick(model, kv="per_recurrence", mode="eager"):
        return next(r for r in rows if r["model"] == model and r["kv_cache"] == kv and r["mode"] == mode)

    grt, iso_flops, iso_params = "grt 1+1x10+1", "dense 12 (iso-FLOPs)", "dense 3 (iso-params)"
    ratios = {"grt_over_dense_iso_flops_latency": pick(grt)["ms_per_token"] / pick(iso_flops)["ms_per_token"],
              "grt_over_dense_iso_params_latency": pick(grt)["ms_per_token"] / pick(iso_params)["ms_per_token"],
              "average_over_full_cache_bytes": pick(grt, "average")["cache_bytes"] / pick(grt)["cache_bytes"],
              "average_over_full_latency": pick(grt, "average")["ms_per_token"] / pick(grt)["ms_per_token"]}
    if args.compile:
        ratios["grt_over_dense_iso_flops_latency_compiled"] = (pick(grt, mode="compiled")["ms_per_token"]
                                                               / pick(iso_flops, mode="compiled")["ms_per_token"])
        ratios["compiled_over_eager_latency_grt"] = (pick(grt, mode="compiled")["ms_per_token"]
                                                     / pick(grt)["ms_per_token"])
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    large = analytic_large(args.context)
    print(f"\nanalytic peak decode memory, bf16, batch 1, {args.context} tokens of context (paper: 639 vs 1570 MB)")
    for name, v in large.items():
        print(f"  {name:<28} weights {v['weights_mb']:7.1f} MB + cache {v['cache_full_mb']:6.1f} (full) / "
              f"{v['cache_average_mb']:6.1f} (averaged) = {v['peak_full_mb']:7.1f} / {v['peak_average_mb']:7.1f} MB")
    out = write_result(args.output, {
        **stamp("decoding", with_torch=True), "width": args.width, "results": rows, **ratios,
        "analytic_large": large,
        "targets": {"grt_over_dense_iso_flops_latency": 1.15, "average_over_full_cache_bytes": 0.5}})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
