"""Pipeline stages balanced by forward FLOPs against stages balanced by layer count, the rule before
2026-12-07 (the head and the embedding counted as nothing), on the same model, layout and batch.

    python tools/bench/pipeline_balance.py [--model tiny_dense] [--vocab 8192] [--pp 2] [--steps 12]

The head costs 2·d·V FLOPs per token: at the medium shape with GPT-2's vocabulary 3.5 layers, which a
layer count leaves on top of the last stage's share. Here the tiny dense model (6 layers, d 128) gets a
vocabulary of 8,192 (the head: 4.6 layers at seq 128) to show the same imbalance on a CPU. Each split is
one `grt-train` launch under torchrun (fp32, ZeRO 1, 8 micro-batches per step); throughput is the median
tokens/s of the steps after the first few. grt-train prints each stage's share of the FLOPs, from which
the expected ratio (the costliest stage's share, layer split over FLOPs split) is reported beside the
measured one. Prints a table and writes tools/bench/results/pipeline_balance.json.
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
    argument_parser, cpu_model, launch_grt_train, parse_args, prepared_prefix, stamp, write_result,
)


def layer_count_split_points(model: str, vocab: int, pp: int) -> list[str]:
    """The split points the old rule chose: stages balanced by layer executions, embedding/norm/head 0."""
    from grt_megatron.model import GRTConfig
    from grt_megatron.parallel.layout import pipeline_unit_names
    from grt_megatron.parallel.pipeline_stages import balanced_stage_starts
    from grt_megatron.training.cli import compose_run_config

    run = compose_run_config([f"model={model}", f"model.vocab_size={vocab}"], world_size=1)
    cfg = GRTConfig.from_recipe(run.model)
    names = pipeline_unit_names(cfg.prelude_layers, cfg.core_layers, cfg.coda_layers, cfg.is_dense)
    layers = [0 if n in ("embedding", "final_norm", "head") else (cfg.core_layers * cfg.recurrences if n == "core"
                                                                  else 1) for n in names]
    return [names[i] for i in balanced_stage_starts(layers, pp)[1:]]


def run(args, run_dir: Path, split_points: list[str] | None) -> tuple[list[dict], list[float], str]:
    train = [f"model={args.model}", f"data={args.data}", f"model.vocab_size={args.vocab}", f"train.iters={args.steps}",
             "train.global_batch_size=16", "train.micro_batch_size=2", "train.eval_interval=100000",
             "train.eval_iters=1", "logging.wandb=disabled", "logging.progress=false",
             "checkpoint.save_at_end=false", f"parallel.pp={args.pp}", "deepspeed.zero_stage=1",
             f"run.dir={run_dir}"]
    if split_points:
        train.append(f"parallel.pp_split_points=[{','.join(split_points)}]")
    proc = launch_grt_train(args.pp, train, port=29978)
    stages = next(line for line in proc.stdout.splitlines() if line.startswith("pipeline stages: "))
    shares = [float(s) for s in re.findall(r"\((\d+)%\)", stages)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, shares, stages.removeprefix("pipeline stages: ")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="tiny_dense")
    parser.add_argument("--vocab", type=int, default=8192, help="model.vocab_size (the head's cost)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--data", default="builtin:pydoc_topics", help="a prepared prefix or a corpus")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (warm-up)")
    args = parse_args(parser, "pipeline_balance")
    old_points = layer_count_split_points(args.model, args.vocab, args.pp)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.data = prepared_prefix(args.data, tmp)
        for name, points in (("layer count", old_points), ("FLOPs", None)):
            records, shares, stages = run(args, Path(tmp) / name.replace(" ", "_"), points)
            steps = [r for r in records if "split" not in r][args.skip:]
            tps = statistics.median(r["tokens_per_s"] for r in steps)
            rows.append({"split": name, "split_points": points, "stages": stages, "costliest_stage_share": max(shares),
                         "tokens_per_s": tps, "loss_at_last_step": steps[-1]["loss"]})
            print(f"{name:<12} {tps:>9.0f} tokens/s   {stages}", flush=True)
    old, new = rows
    result = {
        **stamp("pipeline_balance"), "cpu": cpu_model(), "cpus": os.cpu_count(), "model": args.model,
        "vocab_size": args.vocab, "pp": args.pp, "results": rows,
        "flops_split_over_layer_split_tokens_per_s": new["tokens_per_s"] / old["tokens_per_s"],
        "expected_from_costliest_stage": old["costliest_stage_share"] / new["costliest_stage_share"],
    }
    print(f"FLOPs split / layer-count split: {result['flops_split_over_layer_split_tokens_per_s']:.2f}× tokens/s "
          f"(expected from the costliest stage: {result['expected_from_costliest_stage']:.2f}×)")
    print(f"wrote {write_result(args.output, result)}")


if __name__ == "__main__":
    main()
