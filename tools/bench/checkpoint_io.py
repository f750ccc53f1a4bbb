"""Checkpoint I/O: save and load seconds of a real DeepSpeed engine's checkpoint at data-parallel sizes 1, 2
and 4 (gloo, torchrun), each rank's peak host memory while it saves against the bytes it writes, and the training time a save
costs with checkpoint.async_save off and on (8 steps with a save after the first, minus 8 without).

    python tools/bench/checkpoint_io.py [--dp 1,2,4] [--zero 1] [--hidden 768 --layers 8] [--dir DIR]

The model is dense, d 768, 8 layers (~58 M parameters: 0.7 GB of fp32 weights and Adam moments), so that
the time goes to moving and writing bytes, not to start-up. One training step runs first (the moments
exist), then `save_checkpoint` and `load_checkpoint` as grt-train calls them, timed between barriers. Host
memory is each rank's resident set size, sampled every 2 ms during the save, minus what it was before:
on a CPU run the tensors already live in host memory, so this is what saving adds (buffers, copies).
Writes tools/bench/results/checkpoint_io.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The largest resident set size seen while the block runs (a sampling thread)."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())


class BenchTokenizer:
    """The tokenizer file a checkpoint carries (its contents do not matter to the I/O measured)."""

    file_name = "tokenizer.model"
    model_proto = b"\x00" * 4096

    def save(self, path: Path) -> Path:
        path.write_bytes(self.model_proto)
        return path


def worker(args) -> None:
    """One rank: build, step once, save, load; its numbers as JSON in DIR/rankN.json."""
    import torch
    import torch.distributed as dist

    from grt_megatron.checkpoint import load_checkpoint, save_checkpoint
    from grt_megatron.checkpoint.async_save import AsyncSaver
    from grt_megatron.checkpoint.checkpointer import snapshot_checkpoint
    from grt_megatron.distributed import init_distributed
    from grt_megatron.parallel.parallelize import parallelize

    from hydra import compose, initialize_config_dir

    from grt_megatron.training.config import build_run_config

    info = init_distributed(seed=0)
    world = dist.get_world_size()
    if args.threads:
        torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(common.REPO / "recipes"), version_base="1.3"):
        run = build_run_config(compose("train", overrides=[
            "model=tiny_dense", f"model.hidden_size={args.hidden}", "model.num_attention_heads=12",
            f"model.core_layers={args.layers}", "model.max_sequence_length=64", f"deepspeed.zero_stage={args.zero}",
            "train.micro_batch_size=1", f"train.global_batch_size={world}", "run.dir=unused"]))
    model_cfg = run.model_config(common.CPU_VOCAB)
    engine = parallelize(model_cfg, run).engine
    tokens = torch.randint(0, common.CPU_VOCAB, (1, 65), generator=torch.Generator().manual_seed(info.rank))

    def step():
        loss = engine(tokens[:, :-1], tokens[:, 1:], 1, 1, [info.rank]).mean()
        engine.backward(loss)
        engine.step()

    step()  # the moments exist
    root = Path(args.dir)
    state = {"step": 1, "consumed_samples": world, "tokens": world * 64,
             "layout": {"world_size": world, "tp": 1, "pp": 1, "dp": world, "sp": False,
                        "zero_stage": args.zero, "precision": "fp32"}}

    def timed_steps(save=None) -> float:
        """`args.steps` training steps, with `save()` after the first; wall time until every rank is done
        (and, for an async save, until it is committed: its cost is whatever it takes from these steps)."""
        dist.barrier()
        start = time.perf_counter()
        step()
        if save is not None:
            save()
        for _ in range(args.steps - 1):
            step()
        if saver.in_flight:
            saver.wait()
        dist.barrier()
        return time.perf_counter() - start

    saver = AsyncSaver()
    blocked = {"async": []}
    save_times = []

    def sync_save():
        start = time.perf_counter()
        save_checkpoint(root / "sync", 1, engine, False, BenchTokenizer(), state, 1)
        save_times.append(time.perf_counter() - start)

    def async_save():
        start = time.perf_counter()
        snapshot = snapshot_checkpoint(root / "async", 2, engine, False, BenchTokenizer(), state, 1, copy=True)
        saver.submit(snapshot, lambda path, seconds: None)
        blocked["async"].append(time.perf_counter() - start)

    # Interleaved and repeated: this machine's step times drift; each figure is a median of its repeats.
    runs = {"none": [], "sync": [], "async": []}
    for _ in range(args.repeats):
        runs["none"].append(timed_steps())
        runs["sync"].append(timed_steps(sync_save))
        runs["async"].append(timed_steps(async_save))
    baseline, with_sync, with_async = (statistics.median(runs[k]) for k in ("none", "sync", "async"))
    dist.barrier()
    with PeakRss() as memory:
        start = time.perf_counter()
        path = save_checkpoint(root, 1, engine, False, BenchTokenizer(), state, keep_last=1)
        save_times.append(time.perf_counter() - start)
    dist.barrier()
    save_s = statistics.median(save_times)  # this rank's save call, median of the repeats
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    dp_rank = info.rank  # TP 1, PP 1: the DP rank is the rank
    own = [name for name in manifest if name.startswith("model-")
           and (name == "model-tp00-pp00.safetensors" if dp_rank == 0 else name.endswith(f"-dp{dp_rank:03d}.safetensors"))]
    own_bytes = sum(manifest[name]["bytes"] for name in own)
    model_bytes = sum(entry["bytes"] for name, entry in manifest.items() if name.startswith("model-"))
    load_times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        load_checkpoint(path, engine, False, model_cfg.padded_vocab_size, restore_rngs=True)
        dist.barrier()
        load_times.append(time.perf_counter() - start)
    load_s = statistics.median(load_times)
    (root / f"rank{info.rank}.json").write_text(json.dumps({
        "rank": info.rank, "save_s": save_s, "load_s": load_s, "steps_s": baseline, "steps_with_sync_save_s": with_sync,
        "steps_with_async_save_s": with_async, "async_blocking_s": statistics.median(blocked["async"]),
        "own_bytes": own_bytes, "model_bytes": model_bytes, "peak_host_delta_bytes": memory.peak - memory.base,
        "parameters": sum(p.numel() for p in engine.module.parameters())}))


def run_layout(dp: int, args, port: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix=f"ckpt_io_dp{dp}_", dir=args.dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp}", f"--master_port={port}",
           __file__, "--worker", "--dir", str(work), "--zero", str(args.zero), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--repeats", str(args.repeats), "--threads", str(args.threads),
           "--steps", str(args.steps)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        sys.exit(f"checkpoint_io: DP {dp} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(dp)]
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="of the steps with and without a save")
    parser.add_argument("--steps", type=int, default=8, help="training steps timed with and without a save")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    parser.add_argument("--worker", action="store_true", help=argparse_hidden())
    if "--worker" in sys.argv:
        args, _ = parser.parse_known_args()
        worker(args)
        return
    args = common.parse_args(parser, "checkpoint_io")
    args.dir = args.dir or tempfile.mkdtemp(prefix="checkpoint_io_")
    results = []
    for i, dp in enumerate(int(x) for x in args.dp.split(",")):
        ranks = run_layout(dp, args, 29650 + i)
        row = {"dp": dp, "zero_stage": args.zero, "torch_threads_per_rank": args.threads or "default",
               "parameters": ranks[0]["parameters"],
               "checkpoint_model_bytes": ranks[0]["model_bytes"],
               "save_s": max(r["save_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
               "own_bytes_per_rank": [r["own_bytes"] for r in ranks],
               "peak_host_delta_bytes_per_rank": [r["peak_host_delta_bytes"] for r in ranks],
               # against what the rank writes, and against the whole (TP, PP) shard (a rank that writes
               # nothing, as every DP rank but 0 before parts per rank, still copied the shard)
               "peak_host_bytes_per_rank_over_own_bytes": max(
                   r["peak_host_delta_bytes"] / max(r["own_bytes"], 1) for r in ranks),
               "peak_host_bytes_per_rank_over_shard_bytes": max(
                   r["peak_host_delta_bytes"] / r["model_bytes"] for r in ranks),
               # training time a save costs: N steps with it minus N steps without (max over ranks)
               "steps_timed": args.steps,
               "lost_per_sync_save_s": max(r["steps_with_sync_save_s"] - r["steps_s"] for r in ranks),
               "lost_per_async_save_s": max(r["steps_with_async_save_s"] - r["steps_s"] for r in ranks),
               "async_blocking_s": max(r["async_blocking_s"] for r in ranks)}
        # what the training loop waits for: the whole save, or only the snapshot's copy to host memory
        row["async_blocking_over_sync_save"] = row["async_blocking_s"] / row["save_s"]
        row["async_hides"] = 1 - row["lost_per_async_save_s"] / row["lost_per_sync_save_s"]
        results.append(row)
        print(f"DP {dp} (ZeRO {args.zero}, {row['parameters'] / 1e6:.1f} M parameters, "
              f"{row['checkpoint_model_bytes'] / 2**20:.0f} MiB of tensors): save {row['save_s']:.2f} s, "
              f"load {row['load_s']:.2f} s, written per rank "
              f"{', '.join(f'{b / 2**20:.0f}' for b in row['own_bytes_per_rank'])} MiB, host memory added "
              f"while saving {row['peak_host_bytes_per_rank_over_own_bytes']:.2f}× the rank's own bytes "
              f"({row['peak_host_bytes_per_rank_over_shard_bytes']:.2f}× the shard's); training time lost per save: "
              f"sync {row['lost_per_sync_save_s']:.2f} s, async {row['lost_per_async_save_s']:.2f} s "
              f"(the loop blocked {row['async_blocking_s']:.2f} s, {row['async_blocking_over_sync_save']:.0%} of a sync "
              f"save; net hidden {row['async_hides']:.0%})", flush=True)
    by_dp = {r["dp"]: r for r in results}
    ratios = {f"save_s_dp{dp}_over_dp1": by_dp[dp]["save_s"] / by_dp[1]["save_s"] for dp in by_dp if dp != 1} \
        if 1 in by_dp else {}
    out = common.write_result(args.output, {**common.stamp("checkpoint_io", with_torch=True), "results": results,
                                            "ratios": ratios})
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"wrote {out}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
