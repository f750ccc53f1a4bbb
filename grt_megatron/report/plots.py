"""The report's PNG plots (matplotlib, no display), each written whole or not at all."""

from __future__ import annotations

import statistics
from pathlib import Path

from grt_megatron.files import write_atomic
from grt_megatron.report.load import Run
from grt_megatron.report.markdown import cell_label, probe_hops_of


def _pyplot():
    """matplotlib without a display (SLURM nodes, CI); imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, dpi=120, format="png"))
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
            ax.plot(xs, ys, marker="o", markersize=3, label=cell_label(row))
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
    ax.set_yticks(range(len(paired)), [cell_label(r) for r in paired], fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("best validation loss − dense's, same seed\n(nats/token; dots: seeds, bar: their mean)")
    ax.set_title("Δ vs dense (left of 0: better than dense)")
    ax.grid(alpha=0.3, axis="x")
    _save_figure(fig, path)
    return True


def plot_probe_accuracy(rows: list[dict], path: Path) -> bool:
    """The depth probe's answer accuracy vs k per cell (mean, bars: std over seeds)."""
    hops = probe_hops_of(rows)
    if not hops:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if not r.get("probe"):
            continue
        means = [r["probe"][f"probe_accuracy_k{k}"][0] for k in hops]
        stds = [r["probe"][f"probe_accuracy_k{k}"][1] for k in hops]
        stds = [0.0 if s != s else s for s in stds]  # one seed: no spread
        ax.errorbar(hops, means, yerr=stds, marker="o", markersize=3, capsize=3, label=cell_label(r))
    ax.set_xticks(hops)
    ax.set_xlabel("k (dependent lookups the answer takes)")
    ax.set_ylabel("answer accuracy (exact match)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("depth probe at the last evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save_figure(fig, path)
    return True


def _probe_panels(hops: list[int], draw, xlabel: str, ylabel: str, path: Path) -> None:
    """One panel per k, side by side on a shared accuracy axis; `draw(ax, k)` plots each panel's lines."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(hops), figsize=(3.6 * len(hops), 3.8), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], hops):
        draw(ax, k)
        ax.set_title(f"k = {k}")
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    _save_figure(fig, path)


def plot_probe_vs_r(rows: list[dict], path: Path) -> bool:
    """The depth probe's accuracy vs R at inference, one panel per k."""
    hops = probe_hops_of(rows)
    swept = [r for r in rows if len(r.get("probe_sweep") or {}) > 1]
    if not hops or not swept:
        return False

    def draw(ax, k):
        for r in swept:
            sweep = {int(d): v for d, v in r["probe_sweep"].items() if f"probe_accuracy_k{k}" in v}
            ds = sorted(sweep)
            line, = ax.plot(ds, [sweep[d][f"probe_accuracy_k{k}"] for d in ds], marker="o", markersize=3,
                            label=r["cell"])
            if r["recurrences"] in sweep:
                ax.plot([r["recurrences"]], [sweep[r["recurrences"]][f"probe_accuracy_k{k}"]], marker="*",
                        markersize=11, color=line.get_color())

    _probe_panels(hops, draw, "R at inference (★ trained)", "answer accuracy", path)
    return True


def plot_probe_curves(rows: list[dict], path: Path) -> bool:
    """The depth probe's accuracy over training, one panel per k (mean over seeds, band: ± their std):
    when each depth of lookup is learned, and whether it is learned at all."""
    hops = probe_hops_of(rows)
    traced = [r for r in rows if len(r.get("probe_history") or {}) > 1]
    if not hops or not traced:
        return False

    def draw(ax, k):
        key = f"probe_accuracy_k{k}"
        for r in traced:
            history = {int(s): v[key] for s, v in r["probe_history"].items() if key in v}
            steps = sorted(history)
            means = [history[s][0] for s in steps]
            line, = ax.plot(steps, means, marker="o", markersize=2, label=cell_label(r))
            stds = [history[s][1] for s in steps]
            if all(sd == sd for sd in stds):  # more than one seed
                ax.fill_between(steps, [m - sd for m, sd in zip(means, stds)],
                                [m + sd for m, sd in zip(means, stds)], alpha=0.15, color=line.get_color())

    _probe_panels(hops, draw, "training step", "answer accuracy (band: ± std over seeds)", path)
    return True
