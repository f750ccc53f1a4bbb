"""Tokens/s and model FLOPs utilisation (MFU) of one training step on one device, bf16, through the
framework (megatron-core layers, DeepSpeed ZeRO 0). For a GPU; on a CPU it runs to check the script.

    python tools/bench/gpu_mfu.py [--model medium_grt_isoflops] [--batch 8] [--accumulation 1] [--steps 20]
                                  [--peak-tflops 989]

FLOPs are the model's (executed R, gate and projection counted; `grt_megatron.model.flops`). The peak is
`--peak-tflops`, else the known peak of the GPU (`grt_megatron.training.metrics.PEAK_TFLOPS`). `--compile`
applies train.compile's torch.compile. On CUDA one more step runs under torch.profiler to measure the
host stall: the median step time minus the time at least one kernel ran, i.e. how long the GPU waited
for the host. Each timed step is synchronised before and after; `steady_step_s` (and `steady_mfu`) time
the same number of steps again back to back, as grt-train runs them, the losses read at the end.
Writes tools/bench/results/gpu_mfu.json.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import (  # noqa: E402
    argument_parser,
    parse_args,
    run_config,
    stamp,
    write_result,
)

import torch  # noqa: E402

from grt_megatron.console import freeze_imported_objects  # noqa: E402
from grt_megatron.device import run_device, set_tf32  # noqa: E402
from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import DepthDraw, GRTLanguageModel, train_flops_per_token  # noqa: E402
from grt_megatron.training.metrics import peak_flops_per_device  # noqa: E402


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def kernel_busy_seconds(step) -> dict:
    """Run `step()` once under torch.profiler: the time at least one CUDA kernel ran. The profiler slows the
    host, so the stall is taken against an unprofiled step's time (kernel durations are the same)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **memory_op_profiling()) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        top = profile_top(prof)
    except Exception as err:  # noqa: BLE001 — a profiler that cannot run must not lose the throughput row
        return {"kernel_busy_s": None, "kernels": None, "profiler_error": f"{type(err).__name__}: {err}"}
    return {"kernel_busy_s": _busy_seconds(kernels) / 1e6, "kernels": len(kernels), **top}  # microseconds -> s


def profile_top(prof, rows: int = 12) -> dict:
    """Where the profiled step's time went, for finding host stalls without another device run: the ops
    with the most host (self CPU) time, the kernels with the most device time, and the calls that make
    the host wait for the device (synchronisations, device-to-host copies), in milliseconds."""
    averages = prof.key_averages()

    def device_ms(a) -> float:
        return getattr(a, "self_device_time_total", getattr(a, "self_cuda_time_total", 0.0)) / 1e3

    host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:rows]
    device = sorted(averages, key=device_ms, reverse=True)[:rows]
    waits = [a for a in averages if any(w in a.key for w in ("Synchronize", "cudaMemcpy", "item", "_local_scalar"))]
    return {"top_host_ops": [[a.key, round(a.self_cpu_time_total / 1e3, 3), a.count] for a in host],
            "top_kernels": [[a.key[:120], round(device_ms(a), 3), a.count] for a in device],
            "host_waits": [[a.key, round(a.self_cpu_time_total / 1e3, 3), a.count] for a in waits],
            "top_memory_ops": memory_ops(prof, rows, on_device=any(device_ms(a) > 0 for a in averages))}


# Ops that only move memory, or do one elementwise pass over it: on a GPU their time is bytes / bandwidth,
# and the question is which tensors they move (gradients, weights, activations, logits) and who asked.
MEMORY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::add", "aten::add_", "aten::mul",
              "aten::mul_", "aten::sub", "aten::sub_", "aten::div", "aten::div_", "aten::cat", "aten::fill_",
              "aten::zero_")


def memory_op_profiling() -> dict:
    """torch.profiler's options for `memory_ops`: shapes, and each op's Python stack. The stack needs the
    verbose experimental config on torch 2.11 (the GPU machine's), whose events list no Python frames for
    `cpu_parent` to reach (2.13's do); kernel durations do not change."""
    from torch._C._profiler import _ExperimentalConfig

    return {"record_shapes": True, "with_stack": True, "experimental_config": _ExperimentalConfig(verbose=True)}


def _caller(event) -> str:
    """The nearest Python frame (or autograd node) above a profiled op: who asked for it."""
    parent = event.cpu_parent
    while parent is not None:
        if ".py(" in parent.name or parent.name.startswith("autograd::engine::evaluate_function"):
            return parent.name.split("site-packages/")[-1].replace("autograd::engine::evaluate_function: ", "")
        parent = parent.cpu_parent
    frames = [frame for frame in event.stack if ".py(" in frame]  # no Python frame among the events (2.11)
    return frames[0].split("site-packages/")[-1] if frames else "?"


def memory_ops(prof, rows: int = 12, on_device: bool = True) -> list:
    """The memory-bound ops of a profiled step (`memory_op_profiling`'s options), outermost only (a copy_
    inside a _to_copy counts once), grouped by op, first input's shape and caller: [op, shape, caller,
    device ms (CPU ms where `on_device` is false), count], the most time first. This is what the GPU check's
    `top_kernels` cannot say: whether its copies are gradients, weights, activations or logits."""
    totals: dict = {}
    for event in prof.events():
        if event.name not in MEMORY_OPS:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = parent.name in MEMORY_OPS, parent.cpu_parent
        if nested:
            continue
        shapes = event.input_shapes or [[]]
        key = (event.name, tuple(shapes[0]), _caller(event))
        us = event.device_time_total if on_device else event.cpu_time_total
        time_us, count = totals.get(key, (0.0, 0))
        totals[key] = (time_us + us, count + 1)
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:rows]
    return [[name, list(shape), caller, round(us / 1e3, 3), count] for (name, shape, caller), (us, count) in ranked]


def phase_seconds(step) -> dict:
    """One more step with the device synchronised after each forward, backward and engine step (`step(timed)`
    runs each through `timed(phase, work, *args)`): how the step's wall time splits between them, forward
    and backward summed over the micro-batches, the optimizer's in effect the last engine step's."""
    out = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}

    def timed(phase, work, *args):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = work(*args)
        torch.cuda.synchronize()
        out[phase] += time.perf_counter() - start
        return result

    step(timed)
    return out


def measure_training_step(model: str, batch: int, seq: int, steps: int, warmup: int, precision: str = "bf16",
                          checkpoint_recurrence: bool = False, peak_tflops: float | None = None,
                          vocab: int = 50257, compile: bool = False, accumulation: int = 1) -> dict:
    """`steps` timed training steps (after `warmup`) of recipe `model` through the DeepSpeed engine on this
    process's device, at the full R (fixed depth sampler), compiled as train.compile does if `compile`. A
    step is `accumulation` micro-batches of `batch` sequences and one optimizer step, as grt-train runs a
    global batch larger than the micro-batch (the paper's recipe: 480 sequences, micro-batch 6): the
    optimizer and gradient-norm work, fixed per step, is then shared by more tokens.
    `init_distributed` must have run. Like grt-train, it freezes what the process holds before it builds
    the model (`gc.freeze`), so call it once per process, as both callers do: a second call would also
    freeze the first one's model and engine for good."""
    from grt_megatron.model.kernels import FUSION_FIELDS
    from grt_megatron.parallel.compile import apply_compile, compiled_graphs
    from grt_megatron.parallel.deepspeed_engine import build_engine, clips_outside_deepspeed
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision
    from grt_megatron.training.step_guard import clip_grad_norm, install_step_guard

    # As grt-train (console.py): what the imports made is frozen, so a collection inside a timed step
    # walks only what this run made (a full pass over the imports: ~0.27 s on a 2-core CPU).
    freeze_imported_objects()
    device = run_device()
    cuda = device.type == "cuda"
    run = run_config(model, batch, precision, f"model.max_sequence_length={seq}",
                     f"model.checkpoint_recurrence={str(checkpoint_recurrence).lower()}", accumulation=accumulation)
    tf32 = set_tf32(run.train.tf32)  # as grt-train: fp32 runs use TF32 tensor cores unless train.tf32=false
    model_cfg = run.model_config(vocab)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    module = GRTLanguageModel(model_cfg, init_seed=0).to(device)
    apply_mixed_precision(module, precision, device)  # bf16-mixed: the forward under autocast, as parallelize
    if compile:
        apply_compile(module)
    # As grt-train: with fp32 weights and no ZeRO (bf16-mixed) the step runner clips on the device and
    # the guard decides the skip from that norm; else DeepSpeed's optimizer wrapper clips.
    clips_here = clips_outside_deepspeed(run)
    engine = build_engine(module, run, dp_size=1, clip_in_deepspeed=not clips_here)
    guard = install_step_guard(engine) if clips_here else None
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    r = model_cfg.recurrences
    losses = []

    def forward():
        return engine(x, y, r, r, list(range(batch))).mean()

    def untimed(phase, work, *args):
        return work(*args)

    def step(timed=untimed):
        # As grt-train: the engine steps after every micro-batch and updates the weights at the
        # accumulation boundary only.
        for _ in range(accumulation):
            loss = timed("forward_s", forward)
            timed("backward_s", engine.backward, loss)
            if clips_here and engine.is_gradient_accumulation_boundary():
                timed("optimizer_s", clip, engine.module.parameters())
            timed("optimizer_s", engine.step)
        return loss

    def clip(parameters):
        guard.use_grad_norm(float(clip_grad_norm(parameters, run.train.grad_clip or math.inf)))

    times = []
    first_step_s = None
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i == 0:
            first_step_s = time.perf_counter() - start  # with compile: the compilation
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    step_s = statistics.median(times)
    # The same steps back to back, as grt-train runs them: nothing synchronises between steps and the
    # losses are read at the end, so the host prepares a step while the device finishes the last one.
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    steady_s = (time.perf_counter() - start) / steps
    busy = kernel_busy_seconds(step) if cuda else {"kernel_busy_s": None}
    phases = phase_seconds(step) if cuda else {}
    # How long the GPU waits for the host per step: launch overhead, syncs, Python between kernels.
    stall = None if busy["kernel_busy_s"] is None else max(0.0, step_s - busy["kernel_busy_s"])
    tokens = batch * seq * accumulation  # a step's
    flops = train_flops_per_token(model_cfg, seq, DepthDraw(r, r)) * tokens / step_s
    peak = peak_flops_per_device(precision, peak_tflops, tf32=tf32)
    return {"model": model, "shape": model_cfg.shape_name,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "precision": precision,
            "batch": batch, "accumulation": accumulation, "seq_length": seq, "vocab": vocab, "step_s": times,
            "median_step_s": step_s, "tokens_per_s": tokens / step_s, "model_flops_per_s": flops,
            "peak_flops_per_s": peak,
            "mfu": None if peak is None else flops / peak,
            "steady_step_s": steady_s,
            "steady_mfu": None if peak is None else flops * step_s / steady_s / peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "losses": losses,
            "compiled": compile, "compiled_graphs": compiled_graphs() if compile else None,
            "first_step_s": first_step_s, "layer_spec": model_cfg.layer_spec,
            "fusions": [name for name in FUSION_FIELDS if getattr(model_cfg, name)], "host_stall_s": stall, **busy,
            "phases": phases, "optimizer_steps": engine.global_steps}


# The fields of this benchmark's JSON (measure_training_step returns more).
ROW_FIELDS = ("model", "shape", "device", "precision", "batch", "accumulation", "seq_length", "median_step_s",
              "tokens_per_s", "model_flops_per_s", "mfu", "steady_step_s", "steady_mfu", "peak_memory_gib",
              "compiled", "compiled_graphs",
              "first_step_s", "layer_spec", "fusions", "host_stall_s")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="medium_grt_isoflops")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches a step (gradient accumulation)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "bf16-mixed", "fp32"))
    parser.add_argument("--checkpoint-recurrence", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile as train.compile=true")
    args = parse_args(parser, "gpu_mfu")
    init_distributed(seed=0)
    measured = measure_training_step(args.model, args.batch, args.seq, args.steps, args.warmup, args.precision,
                                     args.checkpoint_recurrence, args.peak_tflops, compile=args.compile,
                                     accumulation=args.accumulation)
    row = {key: measured[key] for key in ROW_FIELDS}
    print(json.dumps(row, indent=2))
    write_result(args.output, {**stamp("gpu_mfu"), **row})


if __name__ == "__main__":
    main()
