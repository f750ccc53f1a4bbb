"""Tokens/s and model FLOPs utilisation (MFU) of one training step on one device, bf16, through the
framework (megatron-core layers, DeepSpeed ZeRO 0). For a GPU; on a CPU it runs to check the script.

    python tools/bench/gpu_mfu.py [--model medium_grt_isoflops] [--batch 8] [--steps 20] [--peak-tflops 989]

FLOPs are the model's (executed R, gate and projection counted; `grt_megatron.model.flops`). The peak is
`--peak-tflops`, else the known peak of the GPU (`grt_megatron.training.metrics.PEAK_TFLOPS`).
Writes tools/bench/results/gpu_mfu.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import (  # noqa: E402
    argument_parser,
    deepspeed_engine,
    parse_args,
    run_config,
    stamp,
    write_result,
)

import torch  # noqa: E402

from grt_megatron.device import run_device, set_tf32  # noqa: E402
from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw, GRTLanguageModel, train_flops_per_token  # noqa: E402
from grt_megatron.training.metrics import peak_flops_per_device  # noqa: E402


def measure_training_step(model: str, batch: int, seq: int, steps: int, warmup: int, precision: str = "bf16",
                          checkpoint_recurrence: bool = False, peak_tflops: float | None = None,
                          vocab: int = 50257) -> dict:
    """`steps` timed training steps (after `warmup`) of recipe `model` through the DeepSpeed engine on this
    process's device, at the full R (fixed depth sampler). `init_distributed` must have run."""
    device = run_device()
    cuda = device.type == "cuda"
    run = run_config(model, batch, precision, f"model.max_sequence_length={seq}",
                     f"model.checkpoint_recurrence={str(checkpoint_recurrence).lower()}")
    tf32 = set_tf32(run.train.tf32)  # as grt-train: fp32 runs use TF32 tensor cores unless train.tf32=false
    model_cfg = run.model_config(vocab)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine = deepspeed_engine(GRTLanguageModel(model_cfg, init_seed=0).to(device), run)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    r = model_cfg.recurrences
    times, losses = [], []
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(x, y, r, r, list(range(batch))).mean()
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    step_s = statistics.median(times)
    flops = train_flops_per_token(model_cfg, seq, DepthDraw(r, r)) * batch * seq / step_s
    peak = peak_flops_per_device(precision, peak_tflops, tf32=tf32)
    return {"model": model, "shape": model_cfg.shape_name,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "precision": precision,
            "batch": batch, "seq_length": seq, "vocab": vocab, "step_s": times, "median_step_s": step_s,
            "tokens_per_s": batch * seq / step_s, "model_flops_per_s": flops, "peak_flops_per_s": peak,
            "mfu": None if peak is None else flops / peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "losses": losses}


# The fields of this benchmark's JSON (measure_training_step returns more).
ROW_FIELDS = ("model", "shape", "device", "precision", "batch", "seq_length", "median_step_s", "tokens_per_s",
              "model_flops_per_s", "mfu", "peak_memory_gib")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="medium_grt_isoflops")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--checkpoint-recurrence", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parse_args(parser, "gpu_mfu")
    init_distributed(seed=0)
    measured = measure_training_step(args.model, args.batch, args.seq, args.steps, args.warmup, args.precision,
                                     args.checkpoint_recurrence, args.peak_tflops)
    row = {key: measured[key] for key in ROW_FIELDS}
    print(json.dumps(row, indent=2))
    write_result(args.output, {**stamp("gpu_mfu"), **row})


if __name__ == "__main__":
    main()
