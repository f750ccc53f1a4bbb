"""Throughput of the same model and global batch in 1, 2 and 4 processes (DP, TP, TP × DP) on gloo:
what each layout's communication costs the framework.

    python tools/bench/scaling.py [--model tiny] [--steps 12]

Each layout is one `grt-train` launch under torchrun (fp32, ZeRO 0 unless the layout says otherwise);
throughput is the median tokens/s of the steps after the first few. On a CPU machine the processes also
share its cores, so `speedup` mixes communication cost with compute contention; per-process numbers on GPUs
come from the same command. Prints a table and writes tools/bench/results/scaling.json.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import (  # noqa: E402
    argument_parser, launch_grt_train, parse_args, prepared_prefix, stamp, write_result,
)

LAYOUTS = [("1 process", 1, []), ("DP 2", 2, []), ("DP 2, ZeRO 1", 2, ["deepspeed.zero_stage=1"]),
           ("TP 2", 2, ["parallel.tp=2"]), ("DP 4", 4, []), ("TP 2 × DP 2", 4, ["parallel.tp=2"]),
           ("TP 4", 4, ["parallel.tp=4"])]


def run(procs: int, layout: list[str], args, run_dir: Path) -> list[dict]:
    train = [f"model={args.model}", f"data={args.data}", f"train.iters={args.steps}", "train.global_batch_size=16",
             "train.micro_batch_size=4", "train.eval_interval=100000", "train.eval_iters=1", "logging.wandb=disabled",
             "logging.progress=false", "checkpoint.save_at_end=false", "model.depth_sampler=fixed",
             f"run.dir={run_dir}", *layout]
    launch_grt_train(procs, train, port=29977)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default="builtin:pydoc_topics", help="a prepared prefix or a corpus")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (warm-up)")
    args = parse_args(parser, "scaling")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.data = prepared_prefix(args.data, tmp)
        for name, procs, layout in LAYOUTS:
            records = run(procs, layout, args, Path(tmp) / re.sub(r"\W+", "_", name))  # hydra-safe path
            steps = [r for r in records if "split" not in r][args.skip:]
            tps = statistics.median(r["tokens_per_s"] for r in steps)
            rows.append({"layout": name, "processes": procs, "overrides": layout, "tokens_per_s": tps,
                         "loss_at_last_step": steps[-1]["loss"]})
            print(f"{name:<14}{procs:>3} procs {tps:>10.0f} tokens/s", flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_over_1_process"] = r["tokens_per_s"] / base
        r["efficiency_per_process"] = r["speedup_over_1_process"] / r["processes"]
    print(f"\n{'layout':<14}{'procs':>6}{'tokens/s':>10}{'speedup':>9}{'per proc':>10}")
    for r in rows:
        print(f"{r['layout']:<14}{r['processes']:>6}{r['tokens_per_s']:>10.0f}{r['speedup_over_1_process']:>9.2f}"
              f"{r['efficiency_per_process']:>10.2f}")
    out = write_result(args.output, {**stamp("scaling"), "cpus": os.cpu_count(), "model": args.model,
                                     "results": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
