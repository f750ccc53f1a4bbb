"""Eager vs compiled (`train.compile`) training steps on CPU: the same GRT, weights and batches, through
the framework's DeepSpeed engine, one process.

    python tools/bench/compile.py [--shapes tiny,small] [--steps 20]

Shapes: tiny (1+1×4+1, d 128) and the small shape (1+1×10+1) at d 256, 4 heads, sequence 128, fp32, full R,
noise on. The two engines' steps are interleaved so that machine noise hits both. The compiled model's
first step includes compilation (reported as `first_step_s`); the median is over the steps after warm-up.
Target: compiled no slower than eager. Prints a table and writes tools/bench/results/compile.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.parallel.compile import apply_compile, compiled_graphs  # noqa: E402


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    args = common.parse_args(parser, "compile")
    init_distributed(seed=0)
    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        engines = {}
        for mode in ("eager", "compiled"):
            run, cfg, engine = common.cpu_step_engine(recipe, args.batch, seed=0, width=width)
            if mode == "compiled":
                apply_compile(engine.module)
            engines[mode] = engine
        seq = cfg.max_sequence_length
        x, y = common.random_batch(args.batch, seq)
        times = {mode: [] for mode in engines}
        losses = {mode: [] for mode in engines}
        graphs_before = compiled_graphs()
        for step in range(args.warmup + args.steps):
            for mode, engine in engines.items():
                start = time.perf_counter()
                loss = engine(x, y, cfg.recurrences, cfg.recurrences, list(range(step, step + args.batch))).mean()
                engine.backward(loss)
                engine.step()
                losses[mode].append(loss.item())
                times[mode].append(time.perf_counter() - start)
        medians = {mode: statistics.median(t[args.warmup:]) for mode, t in times.items()}
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "median_step_s": medians, "first_step_s": {m: t[0] for m, t in times.items()},
               "compiled_graphs": compiled_graphs() - graphs_before,
               "max_relative_loss_difference": max(abs(c - e) / abs(e) for e, c in zip(losses["eager"],
                                                                                          losses["compiled"])),
               "compiled_over_eager_step_time": medians["compiled"] / medians["eager"]}
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}): batch {args.batch} × {seq}, median of "
              f"{args.steps} steps (CPU, fp32)")
        for mode, v in medians.items():
            print(f"  {mode:<10}{1e3 * v:>9.1f} ms   (first step {row['first_step_s'][mode]:.1f} s)")
        print(f"  compiled / eager: {row['compiled_over_eager_step_time']:.3f} (target <= 1.00); "
              f"{row['compiled_graphs']} graphs; losses within {row['max_relative_loss_difference']:.1e}")
    out = common.write_result(args.output, {**common.stamp("compile", with_torch=True), "target": 1.0,
                                            "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
