"""One command that runs grt-megatron's real GPU paths and records what happened.

    python3 tools/gpu_check.py [--output tools/bench/results/gpu_check.json] [--work-dir DIR] [--cpu]
                               [--skip NAME ...] [--steps N] [--previous REPORT] [--budget SECONDS]
                               [--train-override KEY=VALUE ...] [--medium-accumulation N]
                               [--medium-precision bf16|bf16-mixed] [--medium-baseline-precision bf16|bf16-mixed]

Run from the repository root; the package need not be installed (the repository is put on sys.path and the
CLIs run as `python -m grt_megatron...`). With CUDA it checks the GPU in under 9 minutes; without it (or with
`--cpu`) it runs the same code on CPU with tiny shapes and few steps, which is how CI tests this script.
Each check passes or fails on its own, a failure does not stop the later ones, and the exit status is 1 if
any check failed. What each check proves:

  cpu_vs_device_step  one fp32 training step (forward, backward, AdamW) of the tiny GRT from the same seed
                      on CPU and on the device: identical initial weights (megatron initialises on CPU),
                      and losses before and after the step within 1e-4, TF32 off. Each side runs in its
                      own process, set up as a run on that device is (the CPU one with CUDA hidden, so
                      that init_distributed takes the CPU path: gloo and the CPU shims).
  prepare_data        grt-prepare-data trains a tokenizer and writes an indexed dataset, offline.
  train_bf16          grt-train trains the tiny GRT in bf16 (evaluations, checkpoints, depth sweep) and
                      its loss goes down.
  kill_resume_bf16    the same run SIGKILLed after its first checkpoint and resumed with resume=auto logs
                      the uninterrupted run's losses step for step (bit-exact, or the maximum difference).
  depth_sweep         the run logged validation losses at R = 1 ... R + 2.
  hf_export           grt-convert-hf exports the final checkpoint to a Hugging Face folder.
  hf_generate_cache   transformers' AutoModelForCausalLM (trust_remote_code) on the device: greedy
                      generate with use_cache=True and use_cache=False gives the same 20 tokens and scores.
  hf_logits           the exported model's logits equal the framework's on the same tokens (fp32 within
                      1e-4, as tests/test_hf_export.py; bf16 within 2e-2 × max(1, largest logit) of the
                      framework in bf16).
  medium_throughput   medium dense (24 layers) vs medium GRT (2+5×4+2), d 1024, seq 1024, bf16 (or
                      --medium-precision bf16-mixed: fp32 weights under autocast), through the
                      DeepSpeed engine: median step time, tokens/s, model FLOPs/s, MFU, peak memory, the
                      layer spec and fusions in effect (model/kernels.py: TE's layers where installed), and
                      the host stall (median step time minus the time some kernel ran, from one profiled
                      step). On CPU the tiny models stand in and MFU and the stall are null.
  medium_compiled     the same with train.compile's torch.compile (rows also record the compiled graphs and
                      the first, compiling, step's time); with --medium-baseline-precision P, the GRT once
                      more in P, and its step time over that baseline's.
  generate_cli        grt-generate as a user runs it, with no --device (so on the GPU): from the final
                      checkpoint (the framework's model, built on the host and moved) and from the export
                      (transformers, cached), the same 20 greedy tokens. Last, so that a
                      short time guard cuts it rather than the throughput.

Writes a JSON report (atomically) and prints a table. The checks are in gpu_check_checks.py, the
subprocess and time-guard machinery in gpu_check_runner.py, the device-side measurements in
gpu_check_workers.py; this file is the command line and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.gpu_check_checks import CHECK_FUNCTIONS, CHECKS, TRAIN_OVERRIDES  # noqa: E402
from tools.gpu_check_runner import (CheckFailed, Clock, Context, Mode, child_env, log, mode_for, tail,  # noqa: E402
                                    write_json_atomically)

DEFAULT_OUTPUT = REPO / "tools" / "bench" / "results" / "gpu_check.json"
# The whole script must fit in 9 minutes on an H200 (the eager checks in 8, then the compiled throughput);
# a check that would start later fails as "not run".
TIME_BUDGET_S = {"cuda": 540.0, "cpu": 600.0}
# The report's top-level numbers (null when their check did not run): eager, then compiled.
SUMMARY_KEYS = tuple(f"{key}{suffix}" for suffix in ("", "_compiled") for key in (
    "mfu_grt_medium", "mfu_dense_medium", "grt_over_dense_flops_per_s", "grt_over_dense_tokens_per_s",
    "host_stall_s_grt_medium", "host_stall_s_dense_medium")) + (
    "grt_compiled_baseline_precision", "grt_compiled_step_time_over_baseline",
    "grt_compiled_steady_step_time_over_baseline")


def run_check(ctx: Context, name: str) -> dict:
    log(ctx.clock, f"start {name}")
    start = time.perf_counter()
    try:
        passed, detail, summary = CHECK_FUNCTIONS[name](ctx)
    except CheckFailed as err:
        lines = str(err).splitlines()
        # The line that names the error, not a warning printed after it (NCCL's at exit, say).
        errors = [line for line in lines[1:] if re.search(r"\w(Error|Exception)\b|^\s*error:", line)]
        last = errors[-1] if errors else lines[-1]
        passed, detail, summary = False, {"error": str(err)}, " ... ".join(dict.fromkeys([lines[0], last]))
    except Exception:  # noqa: BLE001 — a broken check is recorded, and the next one runs
        error = tail(traceback.format_exc(), 15)
        passed, detail, summary = False, {"error": error}, error.splitlines()[-1]
    seconds = time.perf_counter() - start
    log(ctx.clock, f"{'PASS' if passed else 'FAIL'} {name} ({seconds:.1f} s): {summary}")
    return {"name": name, "passed": bool(passed), "wall_s": round(seconds, 2), "summary": summary, "detail": detail}


# ---- the report --------------------------------------------------------------------------------------------------
def device_description(mode: Mode) -> str:
    import torch

    if mode.name == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpu_check on {report['device']} ({report['mode']} mode, {report['wall_s']:.0f} s)")
    for column in ("check", "result", "s", "summary"):
        table.add_column(column, overflow="fold")
    for check in report["checks"]:
        carried = f" (carried from {check['carried_from']['date'][:10]})" if "carried_from" in check else ""
        table.add_row(check["name"], "[green]pass[/]" if check["passed"] else "[red]FAIL[/]", f"{check['wall_s']:.0f}",
                      check["summary"] + carried)
    Console(width=160).print(table)


def carried_checks(path: Optional[Path], skipped: list[str], mode: str) -> dict[str, dict]:
    """The skipped checks' entries of an earlier report of the same mode, each marked with the date, torch and
    device it ran with."""
    if path is None:
        return {}
    try:
        earlier = json.loads(path.read_text())
        if earlier["mode"] != mode:
            raise SystemExit(f"error: --previous {path}: a {earlier['mode']}-mode report; this run is {mode} mode")
        return {c["name"]: {**c, "carried_from": {"date": earlier["date"], "torch": earlier["torch"],
                                                  "device": earlier["device"]}}
                for c in earlier["checks"] if c["name"] in skipped}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: --previous {path}: not a gpu_check report ({type(err).__name__}: {err})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder, removed after")
    parser.add_argument("--cpu", action="store_true", help="CPU mode even if CUDA is available")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, metavar="NAME",
                        help=f"skip a check (repeatable): {', '.join(CHECKS)}")
    parser.add_argument("--steps", type=int, default=None, help="steps of the bf16 CLI runs (default 50; CPU 8)")
    parser.add_argument("--previous", type=Path, default=None,
                        help="an earlier report of this machine: the checks skipped now are carried from it, "
                             "marked with its date (to rerun only what failed when device time is short)")
    parser.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a grt-train override for the CLI runs (repeatable), e.g. train.fused_adam=true to "
                             "check an option on the device before it becomes a default")
    parser.add_argument("--medium-accumulation", type=int, default=1, metavar="N",
                        help="micro-batches per step in the throughput checks (default 1): with N > 1 the "
                             "optimizer's per-step work is shared by N micro-batches, as in a run whose global "
                             "batch is larger than its micro-batch")
    parser.add_argument("--medium-precision", default="bf16", choices=("bf16", "bf16-mixed"),
                        help="train.precision of the throughput checks (default bf16: DeepSpeed's BF16 optimizer; "
                             "bf16-mixed: fp32 weights, autocast, the trainer's clipping)")
    parser.add_argument("--medium-baseline-precision", default=None, choices=("bf16", "bf16-mixed"),
                        help="also measure the compiled GRT in this precision, on the same card (one more row "
                             "of medium_compiled, about a minute): the baseline that --medium-precision is "
                             "compared with (grt_compiled_step_time_over_baseline)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all checks (default 540 on CUDA, 600 on CPU); a check that would start "
                             "after it fails as 'not run'")
    args = parser.parse_args(argv)
    if args.medium_accumulation < 1:
        parser.error("--medium-accumulation must be >= 1")
    if args.steps is not None and args.steps < 6:
        parser.error("--steps must be >= 6 (the killed run needs steps after its first checkpoint)")

    import torch

    mode = mode_for(torch.cuda.is_available() and not args.cpu, args.steps)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    for sub in ("corpus", "runs", "hf", "hf_home", "logs", "workers"):  # only our own folders, from a last run
        shutil.rmtree(work / sub, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget or TIME_BUDGET_S[mode.name])
    ctx = Context(mode=mode, work=work, clock=clock, env=child_env(mode.name == "cpu", work),
                  medium_accumulation=args.medium_accumulation, medium_precision=args.medium_precision,
                  medium_baseline_precision=args.medium_baseline_precision)
    ctx.results["medium_summary"] = {}
    ctx.results["train_overrides"] = [*TRAIN_OVERRIDES, *args.train_override]
    log(clock, f"{mode.name} mode, work dir {work}, report {args.output}")

    def report(checks: list[dict], complete: bool) -> dict:
        summary = ctx.results.get("medium_summary", {})
        return {
            "device": device_description(mode), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode.name, "wall_s": round(clock.elapsed(), 1),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "complete": complete,
            "checks": checks, "skipped": list(args.skip), "train_overrides": args.train_override,
            "medium_accumulation": args.medium_accumulation, "medium_precision": args.medium_precision,
            **{key: summary.get(key) for key in SUMMARY_KEYS},
            "medium": ctx.results.get("medium", {}), "medium_compiled": ctx.results.get("medium_compiled", {}),
        }

    previous = carried_checks(args.previous, args.skip, mode.name)
    checks = []
    for name in CHECKS:
        if name in args.skip:
            if name in previous:
                checks.append(previous[name])
                log(clock, f"carried {name} from {args.previous}: {'PASS' if previous[name]['passed'] else 'FAIL'}")
            continue
        checks.append(run_check(ctx, name))
        # After every check: a run stopped from outside (a lease running out) still leaves what it measured.
        write_json_atomically(args.output, report(checks, complete=False))
    final = report(checks, complete=True)
    write_json_atomically(args.output, final)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print_table(final)
    failed = [c["name"] for c in checks if not c["passed"]]  # carried ones included: the report is one table
    log(clock, f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; failed: {', '.join(failed)}"
                                                                            if failed else "") + f"; {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
