"""Training-step time of GRT vs dense at equal layer executions ("iso-FLOPs"), through DeepSpeed.

    python tools/bench/step_time.py [--pairs tiny:tiny_dense,small_grt_isoflops:small_dense,...] [--steps 20]

Default pairs: tiny (1+1×4+1 vs 6 layers, d 128), and the small (1+1×10+1 vs 12) and medium (2+5×4+2 vs
24) shapes scaled down to `--width` (d 256, 4 heads, sequence 128) so that they run on a CPU in minutes.

Both models run in one process, steps interleaved (GRT, dense, GRT, ...) so machine noise hits both.
GRT runs its full R every step (depth sampler fixed) so that its FLOPs equal its isoFLOPs definition.
Prints a table and writes tools/bench/results/step_time.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import (  # noqa: E402
    CPU_VOCAB,
    argument_parser,
    cpu_step_engine,
    parse_args,
    stamp,
    write_result,
)

import torch  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw, count_parameters, train_flops_per_token  # noqa: E402


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--pairs", default="tiny:tiny_dense,small_grt_isoflops:small_dense,"
                        "medium_grt_isoflops:medium_dense", help="comma-separated GRT:dense recipe pairs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=256, help="hidden size of the non-tiny pairs (scaled down)")
    args = parse_args(parser, "step_time")
    init_distributed(seed=0)
    results = []
    for pair in args.pairs.split(","):
        names = pair.split(":")
        width = None if names[0].startswith("tiny") else args.width
        built = [cpu_step_engine(name, args.batch, seed=i, width=width) for i, name in enumerate(names)]
        seq = built[0][1].max_sequence_length
        tokens = torch.randint(0, CPU_VOCAB, (args.batch, seq + 1), generator=torch.Generator().manual_seed(0))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        times: list[list[float]] = [[], []]
        for step in range(args.warmup + args.steps):
            for i, (_, cfg, engine) in enumerate(built):
                start = time.perf_counter()
                loss = engine(x, y, cfg.recurrences, cfg.recurrences, list(range(args.batch))).mean()
                engine.backward(loss)
                engine.step()
                if step >= args.warmup:
                    times[i].append(time.perf_counter() - start)
        row = {"pair": pair, "batch": args.batch, "seq_length": seq, "steps": args.steps,
               "hidden_size": built[0][1].hidden_size}
        for i, (name, (_, cfg, _)) in enumerate(zip(names, built)):
            median = statistics.median(times[i])
            flops = train_flops_per_token(cfg, seq, DepthDraw(cfg.recurrences, cfg.recurrences))
            row[name] = {
                "shape": cfg.shape_name, "parameters": count_parameters(cfg)["total"],
                "layer_executions": cfg.depth(), "median_step_s": median,
                "tokens_per_s": args.batch * seq / median, "flops_per_token": flops,
                "flops_per_s": flops * args.batch * seq / median,
            }
        grt, dense = row[names[0]], row[names[1]]
        row["grt_over_dense_step_time"] = grt["median_step_s"] / dense["median_step_s"]
        row["grt_over_dense_tokens_per_s"] = grt["tokens_per_s"] / dense["tokens_per_s"]
        row["grt_over_dense_flops_per_s"] = grt["flops_per_s"] / dense["flops_per_s"]
        results.append(row)
        print(f"\n{pair} (d {row['hidden_size']}): batch {args.batch} × {seq} tokens, median of {args.steps} steps "
              "(CPU, fp32, ZeRO 0)")
        print(f"{'model':<22}{'shape':<10}{'params':>10}{'step ms':>10}{'tok/s':>10}{'GFLOP/s':>10}")
        for name in names:
            r = row[name]
            print(f"{name:<22}{r['shape']:<10}{r['parameters']:>10,}{1e3 * r['median_step_s']:>10.1f}"
                  f"{r['tokens_per_s']:>10.0f}{r['flops_per_s'] / 1e9:>10.2f}")
        print(f"GRT/dense: step time {row['grt_over_dense_step_time']:.3f}, tokens/s "
              f"{row['grt_over_dense_tokens_per_s']:.3f}, FLOPs/s {row['grt_over_dense_flops_per_s']:.3f}")
    out = write_result(args.output, {**stamp("step_time", with_torch=True), "results": results,
                                     "target_grt_over_dense_flops_per_s": 0.95})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
