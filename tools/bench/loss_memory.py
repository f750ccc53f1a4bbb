"""Memory and time of the language-model loss: the chunked vocab-parallel cross-entropy (model/loss.py)
against megatron-core's, which takes fp32 logits (so bf16 logits are first cast whole to fp32).

    python tools/bench/loss_memory.py [--batch 8] [--seq 1024] [--vocab 50304]

Measures forward + backward of the loss alone on given logits (the LM head's output) with `LiveBytes`
(memory_vs_r.py): every tensor storage the loss creates, the logits themselves counted in both; and the
time of one forward + backward apart, also of the chunked loss with its chunks compiled (`train.compile`). Default:
the medium shape's micro-batch (8 × 1024 tokens) at GPT-2's padded vocabulary, bf16 logits.
Prints a table and writes tools/bench/results/loss_memory.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

import torch  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model.loss import chunked_vocab_parallel_cross_entropy  # noqa: E402
from tools.bench.memory_vs_r import LiveBytes  # noqa: E402

LOSSES = {
    "megatron_fp32_cast": lambda logits, target: vocab_parallel_cross_entropy(logits.float(), target),
    "chunked": chunked_vocab_parallel_cross_entropy,
    # train.compile's: each chunk's sums and gradient compiled (one kernel each)
    "chunked_fused": lambda logits, target: chunked_vocab_parallel_cross_entropy(logits, target, fused=True),
}
COMPILED = {"chunked_fused"}


def measure(name: str, batch: int, seq: int, vocab: int, dtype: torch.dtype) -> dict:
    """Peak live bytes (LiveBytes: not for compiled code, which runs op by op under a dispatch mode) and,
    apart, the median time of three forward + backward passes (compiled: after a first, compiling, call)."""
    target = torch.randint(0, vocab, (seq, batch), generator=torch.Generator().manual_seed(0))

    def logits():
        return torch.randn(seq, batch, vocab, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def run(x):
        loss = LOSSES[name](x.requires_grad_(), target)
        loss.sum().backward()
        return loss

    peak = None
    if name not in COMPILED:
        with LiveBytes() as live:
            run(logits())
        peak = live.peak
    else:
        run(logits())  # compiles
    times = []
    for _ in range(3):
        x = logits()
        start = time.perf_counter()
        loss = run(x)
        times.append(time.perf_counter() - start)
    return {"loss": name, "peak_bytes": peak, "logits_bytes": x.numel() * x.element_size(),
            "seconds": statistics.median(times), "mean_loss": float(loss.mean())}


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    args = common.parse_args(parser, "loss_memory")
    init_distributed(seed=0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = {name: measure(name, args.batch, args.seq, args.vocab, dtype) for name in LOSSES}
    gib = 2**30
    print(f"loss forward + backward, {args.batch} × {args.seq} tokens, vocab {args.vocab}, {args.dtype} logits")
    print(f"{'loss':<20}{'peak GiB':>10}{'seconds':>10}{'mean loss':>11}")
    for r in rows.values():
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / gib:.2f}"
        print(f"{r['loss']:<20}{peak:>10}{r['seconds']:>10.2f}{r['mean_loss']:>11.5f}")
    saved = rows["megatron_fp32_cast"]["peak_bytes"] - rows["chunked"]["peak_bytes"]
    chunked, megatron, fused = rows["chunked"], rows["megatron_fp32_cast"], rows["chunked_fused"]
    ratios = {"chunked_over_megatron_peak_bytes": chunked["peak_bytes"] / megatron["peak_bytes"],
              "chunked_over_megatron_seconds": chunked["seconds"] / megatron["seconds"], "saved_bytes": saved,
              "fused_over_chunked_seconds": fused["seconds"] / chunked["seconds"],
              "fused_loss_relative_to_chunked": fused["mean_loss"] / chunked["mean_loss"] - 1}
    print(f"saved {saved / gib:.2f} GiB; chunked/megatron peak {ratios['chunked_over_megatron_peak_bytes']:.3f}, "
          f"time {ratios['chunked_over_megatron_seconds']:.3f}; fused/chunked time "
          f"{ratios['fused_over_chunked_seconds']:.3f}")
    out = common.write_result(args.output, {**common.stamp("loss_memory", with_torch=True), "batch": args.batch,
                                            "seq_length": args.seq, "vocab": args.vocab, "dtype": args.dtype,
                                            "results": list(rows.values()), **ratios})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
