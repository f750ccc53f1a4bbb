"""Framework overhead: the same GRT training step in grt-megatron (megatron-core layers, DeepSpeed ZeRO 0,
one process) and in plain PyTorch (the exported `modeling_grt.py`: torch modules, torch AdamW, torch's grad
clipping), at the same shape, batch and weights.

    python tools/bench/overhead.py [--shapes tiny,small] [--steps 20]

Target: grt-megatron ≤ 1.10× the plain step. Both run their full R in fp32; grt-megatron also draws its
per-sample training noise (plain PyTorch's model has none), which is part of what is measured.
Prints a table and writes tools/bench/results/overhead.json.
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

def plain_step(model, optimizer, x, y):
    logits = model(x, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = common.argument_parser(__doc__)
    common.add_step_arguments(parser)
    args = common.parse_args(parser, "overhead")
    init_distributed(seed=0)
    from deepspeed.runtime.utils import clip_grad_norm_

    results = []
    for shape in args.shapes.split(","):
        recipe, width = common.CPU_SHAPES[shape]
        run, cfg, engine = common.cpu_step_engine(recipe, args.batch, seed=0, width=width)
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
        times = {"grt-megatron": [], "plain PyTorch": []}
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            loss = engine(x, y, cfg.recurrences, cfg.recurrences, list(range(args.batch))).mean()
            engine.backward(loss)
            clip_grad_norm_(list(engine.module.parameters()), t.grad_clip, mpu=engine.mpu)  # as grt-train clips
            engine.step()
            middle = time.perf_counter()
            plain_step(plain, optimizer, x, y)
            end = time.perf_counter()
            if step >= args.warmup:
                times["grt-megatron"].append(middle - start)
                times["plain PyTorch"].append(end - middle)
        medians = {k: statistics.median(v) for k, v in times.items()}
        row = {"shape": shape, "model": cfg.shape_name, "hidden_size": cfg.hidden_size, "batch": args.batch,
               "seq_length": seq, "median_step_s": medians,
               "framework_over_plain_step_time": medians["grt-megatron"] / medians["plain PyTorch"]}
        results.append(row)
        print(f"\n{shape} ({cfg.shape_name}, d {cfg.hidden_size}): batch {args.batch} × {seq}, median of "
              f"{args.steps} steps (CPU, fp32)")
        for k, v in medians.items():
            print(f"  {k:<16}{1e3 * v:>9.1f} ms")
        print(f"  grt-megatron / plain: {row['framework_over_plain_step_time']:.3f} (target <= 1.10)")
    out = common.write_result(args.output, {**common.stamp("overhead", with_torch=True), "target": 1.10,
                                            "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
