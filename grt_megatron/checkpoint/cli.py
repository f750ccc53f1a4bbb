"""`grt-ckpt`: look at checkpoints, mark them permanent, consolidate one into a single fp32 state dict.

    grt-ckpt ls RUN_DIR                       every checkpoint: step, tokens, layout, size, completeness
    grt-ckpt show CHECKPOINT                  one checkpoint in detail (verifies every file's sha256)
    grt-ckpt keep CHECKPOINT                  never prune it
    grt-ckpt consolidate CHECKPOINT --output model.safetensors [--optimizer]
    grt-ckpt relax DENSE_CHECKPOINT --shape 1+1x4+1 --lora-rank 8 --output runs/rrt/checkpoints/step_00000000
                                              an RRT initialised from a dense model (grt-train resume= it)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grt_megatron.checkpoint.store import (
    LATEST,
    PERMANENT,
    CheckpointError,
    checkpoint_root_of,
    inspect_checkpoint,
    list_checkpoints,
    write_file,
)
from grt_megatron.console import quiet_known_warnings
from grt_megatron.errors import ConfigError
from grt_megatron.files import write_atomic


def _layout(state: dict) -> str:
    lay = state.get("layout", {})
    return (f"tp{lay.get('tp')} pp{lay.get('pp')} dp{lay.get('dp')} zero{lay.get('zero_stage')} "
            f"{lay.get('precision')}")


def cmd_ls(args) -> int:
    root = checkpoint_root_of(Path(args.dir))
    if not root.is_dir():
        raise CheckpointError(f"{args.dir}: no such directory")
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    rows = [("checkpoint", "step", "tokens", "layout", "size", "status")]
    for c in list_checkpoints(root):
        status = "complete" if c.complete else f"INCOMPLETE: {c.problem}"
        if c.permanent:
            status += ", permanent"
        if c.path.name == latest:
            status += ", latest"
        rows.append((c.path.name, str(c.step), str(c.state.get("tokens", "?")), _layout(c.state) if c.state else "?",
                     f"{c.bytes / 2**20:.1f} MiB", status))
    for tmp in sorted(root.glob(".tmp-step_*")):
        rows.append((tmp.name, "?", "?", "?", "?", "unfinished save (never resumed from)"))
    if len(rows) == 1:
        print(f"no checkpoints in {root}")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    return 0


def cmd_show(args) -> int:
    info = inspect_checkpoint(Path(args.checkpoint), verify_hashes=True)
    if not info.complete:
        raise CheckpointError(info.problem or f"{args.checkpoint}: incomplete")
    s = info.state
    summary = {
        "path": str(info.path), "step": s["step"], "tokens": s["tokens"], "consumed_samples": s["consumed_samples"],
        "model": s["model_shape"], "layout": s["layout"], "optimizer_steps": s["optimizer_steps"],
        "tokenizer": s["tokenizer"], "version": s["version"], "saved_at": s["saved_at"], "reason": s["reason"],
        "bytes": info.bytes, "permanent": info.permanent, "verified": "every file matches its sha256",
    }
    print(json.dumps(summary, indent=2))
    return 0


def cmd_keep(args) -> int:
    info = inspect_checkpoint(Path(args.checkpoint))
    if not info.complete:
        raise CheckpointError(info.problem or f"{args.checkpoint}: incomplete")
    write_file(info.path / PERMANENT, b"")
    print(f"{info.path}: permanent (never pruned)")
    return 0


def cmd_consolidate(args) -> int:
    from safetensors.torch import save_file

    output = Path(args.output)
    if output.exists():
        raise CheckpointError(f"--output {output} exists; refusing to overwrite it")
    from grt_megatron.checkpoint.consolidate import consolidate

    tensors, meta = consolidate(Path(args.checkpoint), args.optimizer)
    write_atomic(output, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    params = sum(t.numel() for k, t in tensors.items() if "/" not in k)
    print(f"wrote {output}: {len([k for k in tensors if '/' not in k])} tensors, {params:,} parameters (fp32)"
          + (", with Adam moments" if args.optimizer else ""))
    return 0


def cmd_relax(args) -> int:
    from grt_megatron.checkpoint.consolidate import relax_checkpoint

    path = relax_checkpoint(Path(args.checkpoint), Path(args.output), args.shape, args.lora_rank)
    print(f"wrote {path}: RRT {args.shape}, LoRA rank {args.lora_rank}, from {args.checkpoint}; train it with "
          f"grt-train ... resume={path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grt-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list the checkpoints of a run (or a checkpoints folder)")
    p.add_argument("dir")
    p.set_defaults(run=cmd_ls)
    p = sub.add_parser("show", help="one checkpoint in detail, after verifying its files")
    p.add_argument("checkpoint")
    p.set_defaults(run=cmd_show)
    p = sub.add_parser("keep", help="mark a checkpoint permanent (never pruned)")
    p.add_argument("checkpoint")
    p.set_defaults(run=cmd_keep)
    p = sub.add_parser("consolidate", help="merge a checkpoint's shards into one fp32 safetensors state dict")
    p.add_argument("checkpoint")
    p.add_argument("--output", required=True)
    p.add_argument("--optimizer", action="store_true", help="include the Adam moments")
    p.set_defaults(run=cmd_consolidate)
    p = sub.add_parser("relax", help="initialise a Relaxed Recursive Transformer from a dense checkpoint")
    p.add_argument("checkpoint", help="a dense model's checkpoint (or run directory: its newest)")
    p.add_argument("--shape", required=True, help="the RRT's P+KxR+C; P + K·R + C = the dense model's layers")
    p.add_argument("--lora-rank", type=int, required=True, help="rank of each recursion's delta")
    p.add_argument("--output", required=True, help="the new checkpoint, .../checkpoints/step_00000000")
    p.set_defaults(run=cmd_relax)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_known_warnings()
    try:
        return args.run(args)
    except (CheckpointError, ConfigError) as err:  # ConfigError: a model `relax` would build is refused
        print(f"grt-ckpt: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an --output that cannot be written (read-only, under a file)
        print(f"grt-ckpt: error: cannot write {err.filename or 'the output'} ({err.strerror or err})",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
