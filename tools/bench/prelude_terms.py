"""The recurrence step with the prelude's share of W_in and W_1 multiplied once per forward (hoisted,
`GatedRecurrentBlock.prelude_terms`, the default) against the step that multiplies the concatenations
[h + eps_x, h_pre] and [LN_a(h), LN_b(h_pre)] at every step, as the equations are written (what ZeRO 3 runs):
the same GRT, weights and batches, eager and compiled, through the framework's DeepSpeed engine on CPU.

    python tools/bench/prelude_terms.py [--shapes tiny,small] [--steps 20] [--precision fp32]

Shapes as tools/bench/compile.py: tiny (1+1×4+1, d 128) and the small shape (1+1×10+1) at d 256, 4 heads,
sequence 128, full R, noise on. The engines' steps are interleaved so that machine noise hits all of them;
medians over the steps after warm-up. Reports step time, bytes saved for backward and model FLOPs
(flops.py: 6·R·d² + 4·d² for the gate and projection, against the paper's 10·R·d²) as hoisted / concatenated
ratios, and the losses' largest relative difference. Writes tools/bench/results/prelude_terms.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw, train_flops_per_token  # noqa: E402
from grt_megatron.model.flops import _prelude_terms_flops  # noqa: E402
from grt_megatron.parallel.compile import apply_compile  # noqa: E402

MODES = ("eager_hoisted", "eager_concatenated", "compiled_hoisted", "compiled_concatenated")


def concatenated_flops_per_token(cfg, seq: int) -> int:
    """A training step's FLOPs per token when every step multiplies the whole concatenations: the h_pre
    products hoisted once per forward run at every step instead (forward; ×3 with backward)."""
    r = cfg.recurrences
    return train_flops_per_token(cfg, seq, DepthDraw(r, r)) + 3 * (r - 1) * _prelude_terms_flops(cfg)


def prepare(mode: str, engine) -> None:
    """Make `engine` run as `mode`: hoisted (the default) or concatenated, eager or compiled."""
    if mode.endswith("concatenated"):
        engine.module.block.hoists_prelude_terms = lambda: False  # the ZeRO 3 path
    if mode.startswith("compiled"):
        apply_compile(engine.module)


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32")
    args = common.parse_args(parser, "prelude_terms")
    init_distributed(seed=0)
    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        runs = common.compare_step_engines(recipe, args.batch, width, args.precision, MODES, prepare,
                                           args.warmup, args.steps)
        cfg, losses, medians, saved = runs.cfg, runs.losses, runs.medians, runs.saved
        seq = cfg.max_sequence_length
        hoisted_flops = train_flops_per_token(cfg, seq, DepthDraw(cfg.recurrences, cfg.recurrences))
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "precision": args.precision, "median_step_s": medians,
               "saved_for_backward_bytes": saved,
               "train_flops_per_token": {"hoisted": hoisted_flops,
                                         "concatenated": concatenated_flops_per_token(cfg, seq)},
               "max_relative_loss_difference": max(
                   abs(a - b) / abs(b) for mode in ("eager", "compiled")
                   for a, b in zip(losses[f"{mode}_hoisted"], losses[f"{mode}_concatenated"]))}
        row["hoisted_over_concatenated_flops"] = hoisted_flops / row["train_flops_per_token"]["concatenated"]
        for mode in ("eager", "compiled"):
            row[f"hoisted_over_concatenated_step_time_{mode}"] = (medians[f"{mode}_hoisted"]
                                                                  / medians[f"{mode}_concatenated"])
            row[f"hoisted_over_concatenated_saved_bytes_{mode}"] = (saved[f"{mode}_hoisted"]
                                                                    / saved[f"{mode}_concatenated"])
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}, R {cfg.recurrences}): batch {args.batch} × "
              f"{seq}, median of {args.steps} steps (CPU, {args.precision})")
        for mode, v in medians.items():
            print(f"  {mode:<24}{1e3 * v:>9.1f} ms   {saved[mode] / 2**20:7.1f} MiB saved for backward")
        print(f"  hoisted / concatenated: step time {row['hoisted_over_concatenated_step_time_eager']:.3f} eager, "
              f"{row['hoisted_over_concatenated_step_time_compiled']:.3f} compiled; model FLOPs "
              f"{row['hoisted_over_concatenated_flops']:.3f}; losses within {row['max_relative_loss_difference']:.1e}")
    out = common.write_result(args.output, {**common.stamp("prelude_terms", with_torch=True), "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
