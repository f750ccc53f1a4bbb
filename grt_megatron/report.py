"""`grt-report`: compare finished runs — a markdown table, loss curves and loss-vs-R plots.

    grt-report runs/experiments --output docs/results/cpu

RUN_DIRS are run directories (`run_info.json` + `metrics.jsonl`) or folders searched for them. Runs are
grouped into cells by `experiment.name` and `experiment.budget` (else by run name or model shape); a cell's
seeds give the mean ± sample standard deviation. Any subset of a grid works. The output folder gets
`report.md`, `summary.json`, `loss_curves.png`, `delta_vs_dense.png` and `loss_vs_r.png`; each file is
written whole or not at all. Non-dense cells are paired seed by seed with dense, and recurrent ones also with
the GRT cell of their comparison (ablations).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


class ReportError(ValueError):
    """A run directory that cannot be read; the message names the file."""


@dataclass
class Run:
    path: Path
    cell: str
    scale: str
    budget: float
    comparison: str
    variant: str
    seed: int
    shape: str
    recurrences: int
    parameters: int
    flops_nominal: float
    """Training FLOPs per token at the configured R (3 × forward)."""
    flops_executed: float
    """Mean training FLOPs per token over the steps run (the R each step drew; MoR's leavers)."""
    tokens: int
    steps: int
    valid: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, validation loss) per evaluation."""
    train: list[tuple[int, float]] = field(default_factory=list)
    depth_sweep: dict[int, float] = field(default_factory=dict)
    """Validation loss by inference R."""
    finished: bool = True
    """False while the run has not reached train.iters (its numbers are provisional)."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    """The last evaluation's `gate_mean_rN` / `relative_update_rN` (does the gate learn, does h move) and,
    for MoR, `active_fraction_rN` (the share of tokens that ran recursion N)."""
    other_routing: dict[str, float] = field(default_factory=dict)
    """MoR: the best validation loss under its other evaluation routing (`loss_topk_routing` or
    `loss_threshold_routing`), besides `loss` under the run's own."""

    @property
    def best_valid(self) -> float:
        return min(loss for _, loss in self.valid)

    @property
    def final_valid(self) -> float:
        return self.valid[-1][1]


def _number(value) -> float:
    """A metric as a float: metrics.jsonl writes a non-finite value as null (its text under `nonfinite`)."""
    return math.nan if value is None else float(value)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ReportError(f"{path}: cannot read ({err})") from None


def _read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ReportError(f"{path}:{number}: not a JSON record: {line[:60]!r}") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ReportError(f"{path}:{number}: a metrics record needs a 'step' field")
        records.append(record)
    return records


def _flops(model: dict, seq_len: int) -> float:
    from grt_megatron.model import GRTConfig, forward_flops_per_token

    recipe = {k: v for k, v in model.items() if k != "name"}
    return 3.0 * forward_flops_per_token(GRTConfig.from_recipe(recipe), seq_len)["total"]


def load_run(path: Path) -> Optional[Run]:
    """The run at `path`, or None while it has no evaluation yet (a grid still running)."""
    info = _read_json(path / "run_info.json")
    records = _read_metrics(path / "metrics.jsonl")
    config = info.get("config", {})
    experiment = config.get("experiment") or {}
    model = info.get("model")
    if not isinstance(model, dict):
        raise ReportError(f"{path / 'run_info.json'}: no 'model' section")
    seq_len = (config.get("train") or {}).get("seq_length") or model.get("max_sequence_length", 1024)
    tokens_per_step = None
    train, valid, sweep, executed, diagnostics, other_routing = [], [], {}, [], {}, {}
    for r in records:
        split = r.get("split", "train")
        if split == "train" and "loss" in r:
            train.append((int(r["tokens"]), _number(r["loss"])))
            tokens_per_step = tokens_per_step or int(r["tokens"]) // int(r["step"])
            if "flops_per_token" in r:
                executed.append(float(r["flops_per_token"]))
            elif r.get("tokens_per_s"):
                executed.append(float(r["flops_per_s"]) / float(r["tokens_per_s"]))
        elif split == "valid":
            valid.append((int(r["step"]), _number(r["loss"])))
            diagnostics = {k: _number(v) for k, v in r.items()
                           if k.startswith(("gate_mean_r", "relative_update_r", "active_fraction_r"))}
            for k, v in r.items():
                if k.startswith("loss_") and k.endswith("_routing"):
                    other_routing[k] = min(_number(v), other_routing.get(k, math.inf))
        elif split == "depth_sweep":
            sweep[int(r["recurrences"])] = _number(r["loss"])
    if not valid:
        return None
    tokens_per_step = tokens_per_step or 0
    name = experiment.get("name") or (config.get("run") or {}).get("name") or info.get("model_shape", path.name)
    return Run(
        path=path, cell=name, scale=experiment.get("scale") or "-", budget=float(experiment.get("budget", 1.0)),
        comparison=experiment.get("comparison") or "-", variant=experiment.get("variant") or "-",
        seed=int(config.get("seed", 0)), shape=info.get("model_shape", "?"),
        recurrences=int(model.get("recurrences", 1)), parameters=int(info.get("parameters", 0)),
        flops_nominal=_flops(model, seq_len),
        flops_executed=statistics.fmean(executed) if executed else float("nan"),
        tokens=train[-1][0] if train else 0, steps=max(int(r["step"]) for r in records),
        valid=[(step * tokens_per_step, loss) for step, loss in valid], train=train, depth_sweep=sweep,
        diagnostics=diagnostics, other_routing=other_routing, finished=max(int(r["step"]) for r in records) >= int(
            (config.get("train") or {}).get("iters", 0)),
    )


def find_runs(paths: list[Path]) -> list[Run]:
    dirs: list[Path] = []
    for p in paths:
        if not p.exists():
            raise ReportError(f"{p}: no such run directory")
        if (p / "run_info.json").is_file():
            dirs.append(p)
            continue
        found = sorted(q.parent for q in p.rglob("run_info.json") if (q.parent / "metrics.jsonl").is_file())
        if not found:
            raise ReportError(f"{p}: holds no run (no run_info.json with a metrics.jsonl beside it)")
        dirs.extend(found)
    runs = []
    for d in dict.fromkeys(dirs):
        run = load_run(d)
        if run is None:
            print(f"grt-report: skipping {d}: no evaluation yet", file=sys.stderr)
        else:
            runs.append(run)
    return runs


# ---- summary ------------------------------------------------------------------------------------------------
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        cells.setdefault((run.cell, run.budget), []).append(run)
    rows = []
    for (cell, budget), group in cells.items():
        group.sort(key=lambda r: r.seed)
        best, best_std = _mean_std([r.best_valid for r in group])
        final, final_std = _mean_std([r.final_valid for r in group])
        depths = sorted(set.intersection(*(set(r.depth_sweep) for r in group)))
        first = group[0]
        rows.append({
            "cell": cell, "budget": budget, "comparison": first.comparison, "variant": first.variant,
            "shape": first.shape, "recurrences": first.recurrences, "parameters": first.parameters,
            "flops_per_token_nominal": first.flops_nominal,
            "flops_per_token_executed": statistics.fmean(r.flops_executed for r in group),
            "tokens": statistics.fmean(r.tokens for r in group), "seeds": [r.seed for r in group],
            "unfinished": sum(not r.finished for r in group),
            "best_valid_mean": best, "best_valid_std": best_std, "final_valid_mean": final,
            "final_valid_std": final_std,
            "depth_sweep": {r: statistics.fmean(run.depth_sweep[r] for run in group) for r in depths},
            "diagnostics": {k: statistics.fmean(r.diagnostics[k] for r in group)
                            for k in sorted(set.intersection(*(set(r.diagnostics) for r in group)))},
            "other_routing": {k: _mean_std([r.other_routing[k] for r in group])
                              for k in sorted(set.intersection(*(set(r.other_routing) for r in group)))},
            "runs": [str(r.path) for r in group],
        })
    _paired_with_dense(rows, cells)
    _paired_with_grt(rows, cells)
    rows.sort(key=lambda row: (row["budget"], row["best_valid_mean"]))
    return rows


def _paired_with_dense(rows: list[dict], cells: dict[tuple[str, float], list[Run]]) -> None:
    """Best validation loss minus the dense cell's (same scale and budget), seed by seed: the seed fixes the
    data order (and, where `data.valid_seed` is unset, the validation windows) for both runs."""
    _paired(rows, cells, "delta_vs_dense", lambda run: run.variant == "dense", lambda run: (run.scale,),
            pair_reference=True)


def _paired_with_grt(rows: list[dict], cells: dict[tuple[str, float], list[Run]]) -> None:
    """Best validation loss minus the GRT cell's of the same scale, budget and comparison, seed by seed, for
    every other recurrent cell (ablations, baselines). Each piece of the model is initialised from a stream
    keyed by the seed and the piece's name (`model/init.py`), so an ablation starts from the GRT's weights
    wherever it has the same pieces and sees the same batches: the paired runs differ by the switch and what
    it changes downstream, while dense, whose pieces all differ, shares only the batches."""
    _paired(rows, cells, "delta_vs_grt", lambda run: run.variant == "grt", lambda run: (run.scale, run.comparison),
            pair_reference=False)


def _paired(rows, cells, name: str, is_reference, key, pair_reference: bool) -> None:
    """`{name}_mean/_std/_seeds/_by_seed` on every row whose reference cell (`is_reference`, same `key` and
    budget) has runs of the same seeds. `pair_reference`: give the reference its own zero differences too."""
    references = {(*key(g[0]), budget): {r.seed: r.best_valid for r in g}
                  for (cell, budget), g in cells.items() if is_reference(g[0])}
    for row in rows:
        group = cells[(row["cell"], row["budget"])]
        skip = is_reference(group[0]) and not pair_reference
        reference = None if skip else references.get((*key(group[0]), row["budget"]))
        diffs = {r.seed: r.best_valid - reference[r.seed] for r in group if reference and r.seed in reference}
        row[f"{name}_mean"], row[f"{name}_std"] = _mean_std(list(diffs.values())) if diffs else (None, None)
        row[f"{name}_seeds"] = len(diffs)
        row[f"{name}_by_seed"] = diffs


def _fmt_std(mean: float, std: float) -> str:
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def _fmt_unfinished(row: dict) -> str:
    return f" ({row['unfinished']} unfinished)" if row["unfinished"] else ""


def _fmt_delta(row: dict, name: str = "delta_vs_dense") -> str:
    if row[f"{name}_mean"] is None or row["variant"] == "dense":
        return ""
    mean, std = row[f"{name}_mean"], row[f"{name}_std"]
    return f"{mean:+.4f}" if math.isnan(std) else f"{mean:+.4f} ± {std:.4f}"


def _label(row: dict) -> str:
    """The cell's name, with its budget where it is not the 1× one."""
    return row["cell"] + ("" if row["budget"] == 1.0 else f" ({row['budget']:g}×)")


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# Experiment report", "", f"Produced by `{command}`.", "",
             "Validation loss per token at the trained R with noise off, over each cell's seeds (mean ± sample "
             "std); best = lowest over the run's evaluations. FLOPs per token are training FLOPs (3 × forward; "
             "nominal at the configured R, executed = mean over the steps of the R each step ran).", "",
             "Δ vs dense is the best validation loss minus the dense cell's of the same scale and budget, seed by "
             "seed (same data order and validation windows), mean ± std over the paired seeds.", "",
             "| cell | comparison | shape | params | FLOPs/token nominal | FLOPs/token executed | tokens | seeds "
             "| best val loss | final val loss | Δ vs dense |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {_label(r)} | {r['comparison']} | {r['shape']} | {_si(r['parameters'])} | "
            f"{_si(r['flops_per_token_nominal'])} | {_si(r['flops_per_token_executed'])} | {_si(r['tokens'])} | "
            f"{len(r['seeds'])}{_fmt_unfinished(r)} | "
            f"{_fmt_std(r['best_valid_mean'], r['best_valid_std'])} | "
            f"{_fmt_std(r['final_valid_mean'], r['final_valid_std'])} | {_fmt_delta(r)} |")
    swept = [r for r in rows if len(r["depth_sweep"]) > 1]
    if swept:
        top = max(max(r["depth_sweep"]) for r in swept)
        lines += ["", "## Loss vs recurrences at inference", "",
                  "Validation loss when the trained model runs R recurrences (mean over seeds); **bold** is the "
                  "trained R.", "", "| cell | " + " | ".join(f"R={k}" for k in range(1, top + 1)) + " |",
                  "|---|" + "---:|" * top]
        for r in swept:
            cells = []
            for k in range(1, top + 1):
                v = r["depth_sweep"].get(k)
                text = "" if v is None else f"{v:.4f}"
                cells.append(f"**{text}**" if k == r["recurrences"] and text else text)
            lines.append(f"| {r['cell']} | " + " | ".join(cells) + " |")
    gated = [r for r in rows if any(k.startswith("gate_mean_r") for k in r["diagnostics"])]
    if gated:
        depth = max(int(k.rsplit("_r", 1)[1]) for r in gated for k in r["diagnostics"])
        lines += ["", "## Gate and state update at the last evaluation", "",
                  "Per recurrence r: mean gate value g (or MoR's router weight) / relative state update "
                  "‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ (first validation micro-batch, mean over seeds). A gate that "
                  "stays at its initial sigmoid(4) ≈ 0.982 has not learned.", "",
                  "| cell | " + " | ".join(f"r={k}" for k in range(1, depth + 1)) + " |", "|---|" + "---:|" * depth]
        for r in gated:
            d = r["diagnostics"]
            cells = [f"{d[f'gate_mean_r{k}']:.3f} / {d[f'relative_update_r{k}']:.3f}"
                     if f"gate_mean_r{k}" in d and f"relative_update_r{k}" in d else "" for k in range(1, depth + 1)]
            lines.append(f"| {r['cell']} | " + " | ".join(cells) + " |")
    routed = [r for r in rows if r["other_routing"]]
    if routed:
        depth = max(int(k.rsplit("_r", 1)[1]) for r in routed for k in r["diagnostics"]
                    if k.startswith("active_fraction_r"))
        lines += ["", "## MoR: routing at evaluation", "",
                  "Training routes by per-sequence top-k, which compares each token's router score with later "
                  "tokens' scores; the causal rule a decoder can use keeps a token while its router's sigmoid is "
                  "> 0.5 (`model.mor_eval_routing`, `threshold` by default; the tables above use it). Best "
                  "validation loss under each rule (mean ± std over seeds), and the share of tokens that ran each "
                  "recursion under the run's own rule at the last evaluation.", "",
                  "| cell | reported rule | " + " | ".join(
                      k.removeprefix("loss_").removesuffix("_routing") for k in routed[0]["other_routing"])
                  + " | " + " | ".join(f"active r={k}" for k in range(1, depth + 1)) + " |",
                  "|---|---:|" + "---:|" * (len(routed[0]["other_routing"]) + depth)]
        for r in routed:
            others = [_fmt_std(*r["other_routing"][k]) for k in routed[0]["other_routing"]]
            active = [f"{r['diagnostics'][f'active_fraction_r{k}']:.2f}"
                      if f"active_fraction_r{k}" in r["diagnostics"] else "" for k in range(1, depth + 1)]
            lines.append(f"| {r['cell']} | {_fmt_std(r['best_valid_mean'], r['best_valid_std'])} | "
                         + " | ".join(others + active) + " |")
    vs_grt = [r for r in rows if r["delta_vs_grt_seeds"]]
    if vs_grt:
        lines += ["", "## Ablations and baselines vs the GRT", "",
                  "Best validation loss minus the GRT cell's of the same scale, budget and comparison, seed by "
                  "seed. A model piece is initialised from a stream keyed by the seed and the piece's name, so "
                  "same-seed runs of one family start from the same weights wherever they share pieces and see "
                  "the same batches: the two runs differ by the switch and what it changes downstream. (Dense "
                  "shares no piece with a recurrent model, so pairing with it shares only the batches.)", "",
                  "| cell | shape | Δ vs GRT | per seed |", "|---|---|---:|---|"]
        for r in vs_grt:
            seeds = ", ".join(f"{seed}: {d:+.4f}" for seed, d in sorted(r["delta_vs_grt_by_seed"].items()))
            lines.append(f"| {_label(r)} | {r['shape']} | {_fmt_delta(r, 'delta_vs_grt')} | {seeds} |")
    lines += ["", "![validation loss curves](loss_curves.png)", ""]
    if any(r["variant"] != "dense" and r["delta_vs_dense_seeds"] for r in rows):
        lines += ["![difference to dense, seed by seed](delta_vs_dense.png)", ""]
    if swept:
        lines += ["![loss vs R at inference](loss_vs_r.png)", ""]
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------------------------
def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _pyplot():
    """matplotlib without a display (SLURM nodes, CI); imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    _write_atomic(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)


def plot_loss_curves(runs: list[Run], rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    # The dense reference ("both") is drawn in every comparison's panel rather than in one of its own.
    comparisons = sorted({r["comparison"] for r in rows} - {"both"}) or ["both"]
    fig, axes = plt.subplots(1, len(comparisons), figsize=(6.5 * len(comparisons), 4.5), squeeze=False)
    by_cell: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        by_cell.setdefault((run.cell, run.budget), []).append(run)
    for ax, comparison in zip(axes[0], comparisons):
        for row in rows:
            if row["comparison"] not in (comparison, "both"):
                continue
            group = by_cell[(row["cell"], row["budget"])]
            n = min(len(r.valid) for r in group)
            xs = [group[0].valid[i][0] for i in range(n)]
            ys = [statistics.fmean(r.valid[i][1] for r in group) for i in range(n)]
            ax.plot(xs, ys, marker="o", markersize=3, label=_label(row))
            if len(group) > 1:
                lo = [min(r.valid[i][1] for r in group) for i in range(n)]
                hi = [max(r.valid[i][1] for r in group) for i in range(n)]
                ax.fill_between(xs, lo, hi, alpha=0.15)
        ax.set_title(f"validation loss ({comparison})")
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats/token)")
        # The interesting part is the end of training; the first evaluations would flatten it.
        finals = [r.final_valid for r in runs]
        ax.set_ylim(min(finals) - 0.05, max(r.valid[min(2, len(r.valid) - 1)][1] for r in runs) + 0.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save_figure(fig, path)


def plot_loss_vs_r(rows: list[dict], path: Path) -> bool:
    swept = [r for r in rows if len(r["depth_sweep"]) > 1]
    if not swept:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in swept:
        ks = sorted(r["depth_sweep"])
        line, = ax.plot(ks, [r["depth_sweep"][k] for k in ks], marker="o", markersize=3, label=r["cell"])
        if r["recurrences"] in r["depth_sweep"]:
            ax.plot([r["recurrences"]], [r["depth_sweep"][r["recurrences"]]], marker="*", markersize=12,
                    color=line.get_color())
    ax.set_xlabel("recurrences at inference (★ trained R)")
    ax.set_ylabel("validation loss")
    # One badly under-recurred cell (a plain shared layer at R = 1 is ~1.4 nats worse) would flatten every
    # other curve to a line: cut the axis a little above the worst loss at a trained R.
    values = [v for r in swept for v in r["depth_sweep"].values()]
    at_trained = [r["depth_sweep"][r["recurrences"]] for r in swept if r["recurrences"] in r["depth_sweep"]]
    top = max(at_trained, default=max(values)) + 0.2
    if max(values) > top:
        ax.set_ylim(min(values) - 0.02, top)
        ax.set_title(f"under- and over-recurrence (axis cut at {top:.2f}; all values in report.md)", fontsize=10)
    else:
        ax.set_title("under- and over-recurrence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save_figure(fig, path)
    return True


def plot_delta_vs_dense(rows: list[dict], path: Path) -> bool:
    """Each cell's best validation loss minus dense's, seed by seed (dots) and their mean (bar)."""
    paired = [r for r in rows if r["variant"] != "dense" and r["delta_vs_dense_seeds"]]
    if not paired:
        return False
    plt = _pyplot()
    paired = sorted(paired, key=lambda r: (r["budget"], r["delta_vs_dense_mean"]))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(paired) + 1.5))
    for y, r in enumerate(paired):
        ax.barh(y, r["delta_vs_dense_mean"], color="tab:red" if r["delta_vs_dense_mean"] > 0 else "tab:green",
                alpha=0.4)
        seeds = r["delta_vs_dense_by_seed"]
        ax.plot(list(seeds.values()), [y] * len(seeds), "o", color="black", markersize=3)
    ax.set_yticks(range(len(paired)), [_label(r) for r in paired], fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("best validation loss − dense's, same seed\n(nats/token; dots: seeds, bar: their mean)")
    ax.set_title("Δ vs dense (left of 0: better than dense)")
    ax.grid(alpha=0.3, axis="x")
    _save_figure(fig, path)
    return True


def write_report(runs: list[Run], output: Path, command: str) -> list[dict]:
    rows = summarize(runs)
    output.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(runs, rows, output / "loss_curves.png")
    for name, plot in (("loss_vs_r.png", plot_loss_vs_r), ("delta_vs_dense.png", plot_delta_vs_dense)):
        if not plot(rows, output / name) and (output / name).exists():
            (output / name).unlink()  # a stale plot from an earlier report of other runs
    _write_atomic(output / "summary.json", lambda p: p.write_text(json.dumps(rows, indent=2) + "\n"))
    _write_atomic(output / "report.md", lambda p: p.write_text(markdown(rows, command)))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    from grt_megatron.console import quiet_known_warnings

    quiet_known_warnings()
    parser = argparse.ArgumentParser(prog="grt-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or folders holding them")
    parser.add_argument("--output", type=Path, required=True, help="folder for report.md, summary.json, plots")
    args = parser.parse_args(argv)
    command = "grt-report " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        runs = find_runs(args.runs)
        rows = write_report(runs, args.output, command)
    except ReportError as err:
        print(f"grt-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{len(runs)} runs in {len(rows)} cells -> {args.output / 'report.md'}")
    for r in rows:
        print(f"  {r['cell']:<36} {_fmt_std(r['best_valid_mean'], r['best_valid_std'])}")


if __name__ == "__main__":
    main()
