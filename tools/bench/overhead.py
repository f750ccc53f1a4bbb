"""Framework overhead: the same GRT training step in grt-megatron (the step grt-train runs: `parallelize`,
the step runner's `train_step` with its loss, non-finite guard and gradient clipping; megatron-core layers,
DeepSpeed ZeRO 0, one process) and in plain PyTorch (the exported `modeling_grt.py`: torch modules, torch
AdamW, torch's grad clipping), at the same shape, batch and weights.

    python tools/bench/overhead.py [--shapes tiny,small] [--steps 20]

Targets (issue 20): grt-megatron ≤ 1.05× the plain step at the small shape, ≤ 1.10× at tiny. Both run their
full R in fp32. grt-megatron trains with the recipe's per-sample noise (eps_x and eps_g at every step), which
the exported model does not have, so the framework is timed twice, interleaved step by step with the plain
model: with that noise (what a run costs) and at noise σ = 0 (the same math as the plain model: what the
framework itself adds). Prints a table and writes tools/bench/results/overhead.json.
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
from grt_megatron.hf.convert import build_hf_model  # noqa: E402
from grt_megatron.model import DepthDraw  # noqa: E402
from grt_megatron.parallel.parallelize import parallelize  # noqa: E402
from grt_megatron.training.step_guard import LossSpikeDetector, install_step_guard  # noqa: E402
from grt_megatron.training.step_runner import build_step_runner  # noqa: E402

TARGETS = {"tiny": 1.10, "small": 1.05}
"""grt-megatron's step over plain PyTorch's, at most (issue 20)."""

def plain_step(model, optimizer, x, y, grad_clip):
    logits = model(x, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def framework_runner(run, cfg, info):
    """grt-train's model, engine, non-finite guard and step runner for `run` (trainer.py builds the same)."""
    parallel = parallelize(cfg, run)
    guard = install_step_guard(parallel.engine)
    spikes = LossSpikeDetector(run.train.loss_spike_factor, run.train.loss_spike_window)
    return parallel.engine, build_step_runner(parallel, run, info, spikes, valid_samples=0, step_guard=guard)


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    args = common.parse_args(parser, "overhead")
    info = init_distributed(seed=0)

    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        run, cfg = common.cpu_run_config(recipe, args.batch, width)
        engine, runner = framework_runner(run, cfg, info)
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()
                   if torch.is_tensor(v) and not k.endswith("_extra_state")}
        plain = build_hf_model(weights, cfg.to_dict()).train()
        for p in plain.parameters():
            p.requires_grad_(True)
        t = run.train
        optimizer = torch.optim.AdamW(plain.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                                      weight_decay=t.weight_decay)
        seq = cfg.max_sequence_length
        x, y = common.random_batch(args.batch, seq)
        rows = torch.cat([x, y[:, -1:]], dim=1)  # the loader's rows: seq + 1 tokens, shifted in the step
        seeds, draw = list(range(args.batch)), DepthDraw(cfg.recurrences, cfg.recurrences)
        sigma = cfg.noise_sigma
        times = {"grt-megatron": [], "grt-megatron, noise off": [], "plain PyTorch": []}
        names = list(times)
        for step in range(args.warmup + args.steps):
            # The order rotates step by step, so that no model always runs right after another.
            for name in names[step % 3:] + names[:step % 3]:
                # The block reads the noise σ from its config at every step: 0 draws nothing.
                cfg.noise_sigma = 0.0 if name.endswith("noise off") else sigma
                start = time.perf_counter()
                if name == "plain PyTorch":
                    plain_step(plain, optimizer, x, y, t.grad_clip)
                else:
                    runner.train_step(rows, seeds, draw, step)
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        cfg.noise_sigma = sigma
        medians = {k: statistics.median(v) for k, v in times.items()}
        # Each step's own ratio (the three timed back to back), so that the machine's drift over the run
        # cancels; its quartiles say how far one step's ratio strays.
        paired = {k: sorted(a / b for a, b in zip(times[k], times["plain PyTorch"]))
                  for k in ("grt-megatron", "grt-megatron, noise off")}
        quartiles = {k: statistics.quantiles(v, n=4) for k, v in paired.items()}
        target = TARGETS[shape]
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "noise_sigma": sigma, "median_step_s": medians, "target": target,
               "framework_over_plain_step_time": medians["grt-megatron"] / medians["plain PyTorch"],
               "framework_noise_off_over_plain_step_time":
                   medians["grt-megatron, noise off"] / medians["plain PyTorch"],
               "paired_ratio_quartiles": quartiles}
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}): batch {args.batch} × {seq}, median of "
              f"{args.steps} steps (CPU, fp32)")
        for k, v in medians.items():
            print(f"  {k:<26}{1e3 * v:>9.1f} ms")
        print(f"  grt-megatron / plain: {row['framework_over_plain_step_time']:.3f} with noise σ {sigma}, "
              f"{row['framework_noise_off_over_plain_step_time']:.3f} without (target <= {target})")
        for k, (q1, q2, q3) in quartiles.items():
            print(f"  {k} / plain, step by step: median {q2:.3f}, quartiles {q1:.3f}–{q3:.3f}")
    out = common.write_result(args.output, {**common.stamp("overhead", with_torch=True), "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
