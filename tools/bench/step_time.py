"""Training-step time of GRT vs dense at equal layer executions ("iso-FLOPs"), through DeepSpeed.

    python tools/bench/step_time.py [--pairs tiny:tiny_dense,small_grt_isoflops:small_dense,...] [--steps 20]

Default pairs: tiny (1+1×4+1 vs 6 layers, d 128), and the small (1+1×10+1 vs 12) and medium (2+5×4+2 vs
24) shapes scaled down to `--width` (d 256, 4 heads, sequence 128) so that they run on a CPU in minutes.

Both models run in one process, steps interleaved (GRT, dense, GRT, ...) so machine noise hits both.
GRT runs its full R every step (depth sampler fixed) so that its FLOPs equal its isoFLOPs definition.
Prints a table and writes tools/bench/results/step_time.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from grt_megatron.console import quiet_known_warnings  # noqa: E402

quiet_known_warnings()

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw, GRTLanguageModel, count_parameters, train_flops_per_token  # noqa: E402
from grt_megatron.training.config import build_run_config  # noqa: E402
from grt_megatron.parallel.deepspeed_engine import build_engine  # noqa: E402

VOCAB = 2048


def make(model_recipe: str, batch: int, seed: int, width: int | None = None, seq: int = 128):
    scaled = [] if width is None else [f"model.hidden_size={width}", "model.num_attention_heads=4",
                                       f"model.max_sequence_length={seq}"]
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model_recipe}", "model.depth_sampler=fixed", *scaled,
                                          f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
                                          "train.precision=fp32", "run.dir=unused"])
    run = build_run_config(cfg)
    model_cfg = run.model_config(VOCAB)
    torch.manual_seed(seed)
    engine = build_engine(GRTLanguageModel(model_cfg, init_seed=seed), run, dp_size=1)
    return run, model_cfg, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="tiny:tiny_dense,small_grt_isoflops:small_dense,"
                        "medium_grt_isoflops:medium_dense", help="comma-separated GRT:dense recipe pairs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=256, help="hidden size of the non-tiny pairs (scaled down)")
    parser.add_argument("--output", default=str(REPO / "tools" / "bench" / "results" / "step_time.json"))
    args = parser.parse_args()
    init_distributed(seed=0)
    results = []
    for pair in args.pairs.split(","):
        names = pair.split(":")
        width = None if names[0].startswith("tiny") else args.width
        built = [make(name, args.batch, seed=i, width=width) for i, name in enumerate(names)]
        seq = built[0][1].max_sequence_length
        tokens = torch.randint(0, VOCAB, (args.batch, seq + 1), generator=torch.Generator().manual_seed(0))
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
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "step_time", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "command": "python " + " ".join(sys.argv), "results": results,
               "target_grt_over_dense_flops_per_s": 0.95}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
