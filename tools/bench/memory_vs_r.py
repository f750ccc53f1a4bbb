"""Activation memory of a GRT training step as R grows, with and without per-recurrence checkpointing.

    python tools/bench/memory_vs_r.py [--recurrences 2,4,8,16]

Measured exactly, on any device: the bytes of every tensor storage alive during forward and backward that
the step itself made (activations saved for backward, a checkpointed recurrence's inputs and its recompute
in backward, temporaries, gradients), tracked op by op with a `TorchDispatchMode` (each storage counted
once, released when its last tensor is freed). Parameters and the two Adam moments (fixed in R) are added
beside it. Target: with checkpointing, < 10% growth of the step's peak from R 4 to R 16.
Prints a table and writes tools/bench/results/memory_vs_r.json.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import argument_parser, parse_args, stamp, write_result  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402
from grt_megatron.model import GRTConfig, GRTLanguageModel  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops create while the mode is on and that are still referenced;
    `peak` is their maximum. Saved-tensor hooks would miss what torch's non-reentrant checkpoint keeps and
    recomputes (it installs hooks of its own), so this counts allocations instead."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors on it]
        self.total = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return  # an empty tensor
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.total += self.live[key][0]
            self.peak = max(self.peak, self.total)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.total -= entry[0]
            del self.live[key]


def measure(recurrences: int, checkpoint: bool, batch: int, seq: int, width: int, vocab: int) -> dict:
    config = GRTConfig.from_recipe(dict(
        hidden_size=width, num_attention_heads=4, vocab_size=vocab, max_sequence_length=seq, prelude_layers=1,
        core_layers=1, coda_layers=1, recurrences=recurrences, depth_sampler="fixed", add_bias_linear=False,
        checkpoint_recurrence=checkpoint))
    model = GRTLanguageModel(config).train()
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    counter = LiveBytes()
    with counter:
        loss = model(tokens[:, :-1], tokens[:, 1:], recurrences, recurrences, list(range(batch))).mean()
        after_forward = counter.total
        loss.backward()  # a checkpointed recurrence recomputes its activations here, one at a time
    states = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"recurrences": recurrences, "checkpoint_recurrence": checkpoint,
            "live_after_forward_bytes": after_forward, "step_tensors_peak_bytes": counter.peak,
            "parameter_adam_bytes": 3 * states,  # weights, exp_avg, exp_avg_sq (fp32); grads are counted above
            "step_peak_bytes": counter.peak + 3 * states}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--recurrences", default="2,4,8,16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    args = parse_args(parser, "memory_vs_r")
    init_distributed(seed=0)
    rs = [int(r) for r in args.recurrences.split(",")]
    rows = [measure(r, ckpt, args.batch, args.seq, args.width, args.vocab)
            for ckpt in (False, True) for r in rs]
    mib = 2**20
    print(f"GRT 1+1×R+1, d {args.width}, vocab {args.vocab}, batch {args.batch} × {args.seq} tokens, fp32")
    print(f"{'R':>4}{'checkpoint':>12}{'step tensors MiB':>17}{'step peak MiB':>15}")
    for r in rows:
        print(f"{r['recurrences']:>4}{str(r['checkpoint_recurrence']):>12}{r['step_tensors_peak_bytes'] / mib:>17.1f}"
              f"{r['step_peak_bytes'] / mib:>15.1f}")
    growth = {}
    for ckpt in (False, True):
        by_r = {r["recurrences"]: r for r in rows if r["checkpoint_recurrence"] == ckpt}
        if 4 in by_r and 16 in by_r:
            growth["with" if ckpt else "without"] = by_r[16]["step_peak_bytes"] / by_r[4]["step_peak_bytes"] - 1
    for k, v in growth.items():
        print(f"step peak growth R 4 -> 16 {k} checkpointing: {100 * v:+.1f}%")
    out = write_result(args.output, {
        **stamp("memory_vs_r"), "width": args.width, "vocab": args.vocab, "batch": args.batch,
        "seq_length": args.seq, "results": rows, "step_peak_growth_r4_to_r16": growth,
        "target_growth_with_checkpointing": 0.10})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
