"""`grt-report`: compare finished runs — a markdown table, loss curves and loss-vs-R plots.

    grt-report runs/experiments --output docs/results/cpu

RUN_DIRS are run directories (`run_info.json` + `metrics.jsonl`) or folders searched for them. Runs are
grouped into cells by `experiment.name` and `experiment.budget` (else by run name or model shape); a cell's
seeds give the mean ± sample standard deviation. Any subset of a grid works. The output folder gets
`report.md`, `summary.json`, `loss_curves.png`, `delta_vs_dense.png`, `loss_vs_r.png` and, for runs with a depth probe,
`probe_accuracy.png`, `probe_curves.png` (accuracy over training) and `probe_vs_r.png`; each file is
written whole or not at all. Non-dense cells are paired seed by seed with dense, and recurrent ones also with
the GRT cell of their comparison (ablations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from grt_megatron.files import write_atomic
from grt_megatron.report.load import ReportError, Run, find_run_dirs, find_runs, load_run, load_runs
from grt_megatron.report.markdown import fmt_mean_std, markdown
from grt_megatron.report.plots import (
    plot_delta_vs_dense,
    plot_loss_curves,
    plot_loss_vs_r,
    plot_probe_accuracy,
    plot_probe_curves,
    plot_probe_vs_r,
)
from grt_megatron.report.stats import summarize

__all__ = ["ReportError", "Run", "find_runs", "load_run", "main", "markdown", "summarize", "write_report"]


def write_report(runs: list[Run], output: Path, command: str) -> list[dict]:
    rows = summarize(runs)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"--output {output}: cannot create it ({err.strerror or err})") from None
    plot_loss_curves(runs, rows, output / "loss_curves.png")
    for name, plot in (("loss_vs_r.png", plot_loss_vs_r), ("delta_vs_dense.png", plot_delta_vs_dense),
                       ("probe_accuracy.png", plot_probe_accuracy), ("probe_curves.png", plot_probe_curves),
                       ("probe_vs_r.png", plot_probe_vs_r)):
        if not plot(rows, output / name) and (output / name).exists():
            (output / name).unlink()  # a stale plot from an earlier report of other runs
    write_atomic(output / "summary.json", lambda p: p.write_text(json.dumps(rows, indent=2) + "\n"))
    write_atomic(output / "report.md", lambda p: p.write_text(markdown(rows, command)))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    from grt_megatron.console import import_frozen, quiet_known_warnings

    quiet_known_warnings()
    parser = argparse.ArgumentParser(prog="grt-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or folders holding them")
    parser.add_argument("--output", type=Path, required=True, help="folder for report.md, summary.json, plots")
    args = parser.parse_args(argv)
    command = "grt-report " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        dirs = find_run_dirs(args.runs)  # a mistyped path fails in a second, before the imports below
        import_frozen("matplotlib", "grt_megatron.model")  # for the plots (pyplot once its backend is set), the FLOPs
        runs = load_runs(dirs)
        if not runs:
            raise ReportError(f"no run among {', '.join(map(str, args.runs))} has an evaluation yet")
        rows = write_report(runs, args.output, command)
    except ReportError as err:
        print(f"grt-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # the runs were read: what failed is writing the report (a read-only --output)
        print(f"grt-report: error: --output {args.output}: cannot write "
              f"{err.filename or 'the report'} ({err.strerror or err})", file=sys.stderr)
        sys.exit(2)
    print(f"{len(runs)} runs in {len(rows)} cells -> {args.output / 'report.md'}")
    for r in rows:
        print(f"  {r['cell']:<36} {fmt_mean_std(r['best_valid_mean'], r['best_valid_std'])}")
