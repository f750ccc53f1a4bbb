"""The three training precisions side by side on the CPU: fp32, bf16 (DeepSpeed's BF16 optimizer: bf16 weights,
fp32 master copies and gradient buffers) and bf16-mixed (fp32 weights and optimizer, the forward under
autocast). Each trains the same shape from the same weights through the step grt-train runs (`parallelize`,
the step runner, the non-finite guard, clipping at 1.0), one process, DeepSpeed ZeRO 0.

    python tools/bench/precision.py [--shapes tiny,small] [--steps 20]

Per precision: the median step time; the host waits of one step (reads of a device value with device work
queued before them: what drains a GPU's queue, counted on the CPU by `HostWaitCounter`); the bytes per
parameter of every live tensor after a step (weights, gradients, master copies, buffers, Adam moments:
counted from the tensors themselves); and the loss after the timed steps against fp32's. The steps
interleave the precisions, so that the machine's drift is shared. On the CPU the times are not a GPU's (bf16
matmuls run on AVX-512 BF16 here); the waits and the bytes are the same on a GPU. Writes
tools/bench/results/precision.json.
"""

from __future__ import annotations

import gc
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
from tools.bench.overhead import framework_runner  # noqa: E402

PRECISIONS = ("fp32", "bf16", "bf16-mixed")


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage once (views share theirs)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # objects that fail isinstance-like probing (lazy modules, weakref proxies)
            continue
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    args = common.parse_args(parser, "precision")
    info = init_distributed(seed=0)

    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        runners, state_bytes, waits, losses = {}, {}, {}, {}
        for precision in PRECISIONS:
            run, cfg = common.cpu_run_config(recipe, args.batch, width, precision=precision)
            if not runners:  # the batch, made once
                seq = cfg.max_sequence_length
                x, y = common.random_batch(args.batch, seq)
                rows = torch.cat([x, y[:, -1:]], dim=1)
                seeds, draw = list(range(args.batch)), DepthDraw(cfg.recurrences, cfg.recurrences)
                parameters = None
            before = live_tensor_bytes()
            torch.manual_seed(0)
            _, runner = framework_runner(run, cfg, info)
            runner.train_step(rows, seeds, draw, 0)  # Adam's moments exist after a first step
            # What the engine keeps between steps (the step's activations are freed by now).
            grown = live_tensor_bytes() - before
            parameters = parameters or sum(p.numel() for p in runner.engine.module.parameters())
            runners[precision], state_bytes[precision] = runner, grown / parameters
        times = {p: [] for p in PRECISIONS}
        for step in range(1, args.warmup + args.steps):
            for precision in PRECISIONS[step % 3:] + PRECISIONS[:step % 3]:
                start = time.perf_counter()
                out = runners[precision].train_step(rows, seeds, draw, step)
                if step >= args.warmup:
                    times[precision].append(time.perf_counter() - start)
                losses[precision] = out.loss
        for precision in PRECISIONS:
            with HostWaitCounter(host_resident_tensors(runners[precision].engine.basic_optimizer)) as counter:
                runners[precision].train_step(rows, seeds, draw, args.warmup + args.steps)
            waits[precision] = {"host_waits": counter.waits, "host_reads": counter.reads}
        medians = {p: statistics.median(v) for p, v in times.items()}
        cfg = runners["fp32"].engine.module.config
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "parameters": parameters, "median_step_s": medians, **{
                   f"host_waits_per_step_{p.replace('-', '_')}": waits[p]["host_waits"] for p in PRECISIONS},
               "host_reads_per_step": {p: waits[p]["host_reads"] for p in PRECISIONS},
               "state_bytes_per_parameter": state_bytes,
               "loss_after_steps": losses,
               "bf16_mixed_over_bf16_step_time": medians["bf16-mixed"] / medians["bf16"],
               "bf16_mixed_over_fp32_step_time": medians["bf16-mixed"] / medians["fp32"],
               "bf16_mixed_loss_relative_to_fp32": losses["bf16-mixed"] / losses["fp32"] - 1,
               "bf16_loss_relative_to_fp32": losses["bf16"] / losses["fp32"] - 1}
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}, {parameters:,} parameters): batch {args.batch} × "
              f"{seq}, median of {args.steps} steps (CPU)")
        for p in PRECISIONS:
            print(f"  {p:<11}{1e3 * medians[p]:>9.1f} ms  host waits {waits[p]['host_waits']:>2} "
                  f"(reads {waits[p]['host_reads']:>2})  {state_bytes[p]:5.1f} B/parameter  "
                  f"loss {losses[p]:.5f}")
    out = common.write_result(args.output, {**common.stamp("precision", with_torch=True), "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
