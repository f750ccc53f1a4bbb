"""Eager vs compiled (`train.compile`) training steps on CPU: the same GRT, weights and batches, through
the framework's DeepSpeed engine, one process.

    python tools/bench/compile.py [--shapes tiny,small] [--steps 20] [--precision bf16-mixed]

Shapes: tiny (1+1×4+1, d 128) and the small shape (1+1×10+1) at d 256, 4 heads, sequence 128, full R,
noise on; fp32, or `--precision bf16-mixed` (results in compile_bf16_mixed.json), which adds a third
engine: compiled with autocast's casts of the recurrence step's weights left inside the step's graph (once
per step) instead of hoisted out of it (once per forward, `StepWithWeightsCastOnce`). The engines' steps
are interleaved so that machine noise hits all of them. A compiled model's first step includes
compilation (reported as `first_step_s`); the median is over the steps after warm-up.
Target: compiled no slower than eager. Prints a table and writes tools/bench/results/compile.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.parallel.compile import apply_compile, compiled_graphs  # noqa: E402


def prepare(mode: str, engine) -> None:
    """Make `engine` run as `mode`: eager as built, compiled with the step's weights cast once per forward
    or (`compiled_casts_in_graph`) inside the step's graph."""
    if mode != "eager":
        apply_compile(engine.module, cast_weights_once=mode == "compiled")


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32")
    args = common.parse_args(parser, "compile")
    name = "compile" if args.precision == "fp32" else "compile_bf16_mixed"
    if Path(args.output).name == "compile.json":  # the default: each precision has its own results file
        args.output = str(Path(args.output).with_name(f"{name}.json"))
    init_distributed(seed=0)
    modes = ("eager", "compiled") + (("compiled_casts_in_graph",) if args.precision == "bf16-mixed" else ())
    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        graphs_before = compiled_graphs()
        runs = common.compare_step_engines(recipe, args.batch, width, args.precision, modes, prepare,
                                           args.warmup, args.steps)
        cfg, times, losses, medians, saved = runs.cfg, runs.times, runs.losses, runs.medians, runs.saved
        seq = cfg.max_sequence_length
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "median_step_s": medians, "first_step_s": {m: t[0] for m, t in times.items()},
               "compiled_graphs": compiled_graphs() - graphs_before, "saved_for_backward_bytes": saved,
               "max_relative_loss_difference": max(abs(c - e) / abs(e) for e, c in zip(losses["eager"],
                                                                                          losses["compiled"])),
               "compiled_over_eager_step_time": medians["compiled"] / medians["eager"]}
        if "compiled_casts_in_graph" in medians:
            row["casts_once_over_in_graph_step_time"] = medians["compiled"] / medians["compiled_casts_in_graph"]
            row["casts_once_over_in_graph_saved_bytes"] = saved["compiled"] / saved["compiled_casts_in_graph"]
            row["max_relative_loss_difference_casts_in_graph"] = max(
                abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled_casts_in_graph"]))
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}, R {cfg.recurrences}): batch {args.batch} × "
              f"{seq}, median of {args.steps} steps (CPU, {args.precision})")
        for mode, v in medians.items():
            print(f"  {mode:<24}{1e3 * v:>9.1f} ms   (first step {row['first_step_s'][mode]:.1f} s)   "
                  f"{saved[mode] / 2**20:7.1f} MiB saved for backward")
        print(f"  compiled / eager: {row['compiled_over_eager_step_time']:.3f} (target <= 1.00); "
              f"{row['compiled_graphs']} graphs; losses within {row['max_relative_loss_difference']:.1e}")
        if "casts_once_over_in_graph_step_time" in row:
            print(f"  weights cast once / in the step's graph: {row['casts_once_over_in_graph_step_time']:.3f} "
                  f"step time, {row['casts_once_over_in_graph_saved_bytes']:.3f} bytes saved for backward")
    out = common.write_result(args.output, {**common.stamp(name, with_torch=True), "precision": args.precision,
                                            "target": 1.0, "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
