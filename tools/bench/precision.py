"""The training precisions side by side on the CPU: fp32, bf16 (DeepSpeed's BF16 optimizer: bf16 weights,
fp32 master copies and gradient buffers), bf16-mixed (fp32 weights and optimizer, the forward under
autocast), and bf16-mixed with `model.fp32_residual_connection=true` (the layers' residual stream in
fp32). Each trains the same shape from the same weights through the step grt-train runs (`parallelize`, the
step runner, the non-finite guard, clipping at 1.0), one process, DeepSpeed ZeRO 0.

    python tools/bench/precision.py [--shapes tiny,small] [--steps 20]

Per precision: the median step time; the host waits of one step (reads of a device value with device work
queued before them: what drains a GPU's queue, counted on the CPU by `HostWaitCounter`); the bytes per
parameter that each engine keeps between steps (weights, master copies, gradient buffers, Adam moments:
the tensors created while it was built and took a first step that are still alive, counted by
`LiveBytes`); the activations one training forward saves for backward; and the loss after the timed
steps against fp32's. The steps
interleave the precisions, so that the machine's drift is shared. On the CPU the times are not a GPU's (bf16
matmuls run on AVX-512 BF16 here); the waits and the bytes are the same on a GPU. Writes
tools/bench/results/precision.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

import torch  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw  # noqa: E402
from grt_megatron.training.host_waits import HostWaitCounter, host_resident_tensors  # noqa: E402
from tools.bench.memory_vs_r import LiveBytes  # noqa: E402
from tools.bench.overhead import framework_runner  # noqa: E402

VARIANTS = {"fp32": ("fp32", ()), "bf16": ("bf16", ()), "bf16-mixed": ("bf16-mixed", ()),
            "bf16-mixed-fp32-residual": ("bf16-mixed", ("model.fp32_residual_connection=true",))}
"""Each column: its train.precision and grt-train overrides."""
PRECISIONS = tuple(VARIANTS)


def measure_shape(shape: str, args, info) -> dict:
    """The precisions at `shape`. The bytes an engine keeps are those of the tensors created while it
    was built and took a first step that are still alive after it (`LiveBytes`); the activations are the
    bytes one forward saves for backward."""
    recipe, width = common.CPU_SHAPES[shape]
    runners, state_bytes, waits, losses, times = {}, {}, {}, {}, {p: [] for p in PRECISIONS}
    parameters = None
    for precision in PRECISIONS:
        run, cfg = common.cpu_run_config(recipe, args.batch, width, precision=VARIANTS[precision][0],
                                         overrides=VARIANTS[precision][1])
        if parameters is None:  # the batch, made once
            seq = cfg.max_sequence_length
            x, y = common.random_batch(args.batch, seq)
            rows = torch.cat([x, y[:, -1:]], dim=1)
            seeds, draw = list(range(args.batch)), DepthDraw(cfg.recurrences, cfg.recurrences)
        torch.manual_seed(0)
        with LiveBytes() as live:
            runners[precision] = framework_runner(run, cfg, info)[1]
            runners[precision].train_step(rows, seeds, draw, 0)  # Adam's moments exist after a first step
        parameters = parameters or sum(p.numel() for p in runners[precision].engine.module.parameters())
        # What the engine keeps between steps: weights, master copies, gradient buffers, moments (the
        # step's activations are freed by now).
        state_bytes[precision] = live.total / parameters
    for step in range(1, args.warmup + args.steps):
        turn = step % len(PRECISIONS)
        for precision in PRECISIONS[turn:] + PRECISIONS[:turn]:
            start = time.perf_counter()
            losses[precision] = runners[precision].train_step(rows, seeds, draw, step).loss
            if step >= args.warmup:
                times[precision].append(time.perf_counter() - start)
    for precision in PRECISIONS:
        with HostWaitCounter(host_resident_tensors(runners[precision].engine.basic_optimizer)) as counter:
            runners[precision].train_step(rows, seeds, draw, args.warmup + args.steps)
        waits[precision] = {"host_waits": counter.waits, "host_reads": counter.reads}
    medians = {p: statistics.median(v) for p, v in times.items()}
    activations = {p: common.saved_for_backward_bytes(runners[p].engine, x, y, cfg.recurrences) for p in PRECISIONS}
    cfg = runners["fp32"].engine.module.config
    return {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
            "seq_length": seq, "parameters": parameters, "steps": args.steps, "median_step_s": medians,
            **{f"host_waits_per_step_{p.replace('-', '_')}": waits[p]["host_waits"] for p in PRECISIONS},
            "host_reads_per_step": {p: waits[p]["host_reads"] for p in PRECISIONS},
            "state_bytes_per_parameter": state_bytes, "saved_for_backward_bytes": activations,
            "loss_after_steps": losses,
            "bf16_mixed_over_bf16_step_time": medians["bf16-mixed"] / medians["bf16"],
            "bf16_mixed_over_fp32_step_time": medians["bf16-mixed"] / medians["fp32"],
            "bf16_mixed_loss_relative_to_fp32": losses["bf16-mixed"] / losses["fp32"] - 1,
            "bf16_loss_relative_to_fp32": losses["bf16"] / losses["fp32"] - 1,
            "fp32_residual_over_bf16_mixed_step_time": medians["bf16-mixed-fp32-residual"] / medians["bf16-mixed"],
            "fp32_residual_over_bf16_mixed_saved_bytes": (activations["bf16-mixed-fp32-residual"]
                                                          / activations["bf16-mixed"]),
            "bf16_mixed_fp32_residual_loss_relative_to_fp32": losses["bf16-mixed-fp32-residual"] / losses["fp32"] - 1}


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    args = common.parse_args(parser, "precision")
    info = init_distributed(seed=0)
    results = []
    for shape in args.shapes.split(","):
        row = measure_shape(shape, args, info)
        results.append(row)
        print(f"\n{shape} ({row['model']}, d {row['hidden_size']}, {row['parameters']:,} parameters): batch "
              f"{row['batch']} × {row['seq_length']}, median of {row['steps']} steps (CPU)")
        for p in PRECISIONS:
            print(f"  {p:<25}{1e3 * row['median_step_s'][p]:>9.1f} ms  host waits "
                  f"{row['host_waits_per_step_' + p.replace('-', '_')]:>2} (reads {row['host_reads_per_step'][p]:>2})  "
                  f"{row['state_bytes_per_parameter'][p]:5.1f} B/parameter  "
                  f"{row['saved_for_backward_bytes'][p] / 2**20:6.1f} MiB activations  "
                  f"loss {row['loss_after_steps'][p]:.5f}")
    out = common.write_result(args.output, {**common.stamp("precision", with_torch=True), "results": results})
    print(f"\nwrote {out}")

if __name__ == "__main__":
    main()
