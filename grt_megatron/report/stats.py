"""Cells of runs: mean ± std over seeds, and differences to dense and to the GRT, paired seed by seed."""

from __future__ import annotations

import statistics
from typing import Any

from grt_megatron.report.load import Run


PROBE_LEARNED_ACCURACY = 0.9
"""A k counts as learned at the first evaluation whose answer accuracy reaches this: well above the plateau of
a model that picks one of the prompt's chains' digits (1/chains; 0.5 with the probe's two chains)."""


def probe_hops(keys) -> list[int]:
    """The k values among depth-probe metric names (`probe_accuracy_kK`), sorted."""
    return sorted(int(k.rsplit("_k", 1)[1]) for k in keys if k.startswith("probe_accuracy_k"))


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
            "exit_rule": (_mean_std([r.exit_rule for r in group])
                          if all(r.exit_rule is not None for r in group) else None),
            "probe": {k: _mean_std([r.probe[k] for r in group])
                      for k in sorted(set.intersection(*(set(r.probe) for r in group)))},
            "probe_sweep": _probe_sweep(group),
            "probe_history": _probe_history(group),
            "probe_learned_at": _probe_learned_at(group),
            "runs": [str(r.path) for r in group],
        })
    _paired_with_dense(rows, cells)
    _paired_with_grt(rows, cells)
    _probe_paired_with_dense(rows, cells)
    rows.sort(key=lambda row: (row["budget"], row["best_valid_mean"]))
    return rows


def _probe_sweep(group: list[Run]) -> dict[int, dict[str, float]]:
    """The depth probe by inference R, mean over the seeds, at the R every seed swept."""
    depths = sorted(set.intersection(*(set(r.probe_sweep) for r in group)))
    return {d: {k: statistics.fmean(r.probe_sweep[d][k] for r in group)
                for k in sorted(set.intersection(*(set(r.probe_sweep[d]) for r in group)))} for d in depths}


def _probe_history(group: list[Run]) -> dict[int, dict[str, tuple[float, float]]]:
    """The depth probe at each training step every seed evaluated: (mean, std) over the seeds."""
    histories = [dict(r.probe_history) for r in group]
    steps = sorted(set.intersection(*(set(h) for h in histories)))
    return {s: {k: _mean_std([h[s][k] for h in histories])
                for k in sorted(set.intersection(*(set(h[s]) for h in histories)))} for s in steps}


def _probe_learned_at(group: list[Run]) -> dict[int, list[int | None]]:
    """Per k, each seed's first evaluation step with accuracy >= PROBE_LEARNED_ACCURACY (None: never), in the
    order of the cell's seeds. Seeds of one cell can split into runs that learn a k and runs that never do;
    a mean over them hides that, and when the split is drawn in training is part of the answer."""
    evaluations = [set(p) for r in group for _, p in r.probe_history]
    if not evaluations or not all(r.probe_history for r in group):
        return {}
    keys = set.intersection(*evaluations)
    hops = probe_hops(keys)
    histories = [dict(r.probe_history) for r in group]  # as _probe_history: a step logged twice counts once
    return {k: [next((step for step in sorted(h) if h[step][f"probe_accuracy_k{k}"] >= PROBE_LEARNED_ACCURACY),
                     None) for h in histories]
            for k in hops}


def _paired_with_dense(rows: list[dict], cells: dict[tuple[str, float], list[Run]]) -> None:
    """Best validation loss minus the dense cell's (same scale and budget), seed by seed: the seed fixes the
    data order (and, where `data.valid_seed` is unset, the validation windows) for both runs. The reference
    is the dense cell of comparison `both`; other dense cells of the scale (the probe's depth curve, dense 3
    and 12) are compared with it like any other cell."""
    _paired(rows, cells, "delta_vs_dense", _is_reference_run, lambda run: (run.scale,), pair_reference=True)


def _paired_with_grt(rows: list[dict], cells: dict[tuple[str, float], list[Run]]) -> None:
    """Best validation loss minus the GRT cell's of the same scale, budget and comparison, seed by seed, for
    every other recurrent cell (ablations, baselines). Each piece of the model is initialised from a stream
    keyed by the seed and the piece's name (`model/init.py`), so an ablation starts from the GRT's weights
    wherever it has the same pieces and sees the same batches: the paired runs differ by the switch and what
    it changes downstream, while dense, whose pieces all differ, shares only the batches."""
    _paired(rows, cells, "delta_vs_grt", lambda run: run.variant == "grt", lambda run: (run.scale, run.comparison),
            pair_reference=False)


def _probe_paired_with_dense(rows: list[dict], cells: dict[tuple[str, float], list[Run]]) -> None:
    """`probe_delta_vs_dense`: per probe metric (accuracy and answer nll at each k, last evaluation), the
    cell's value minus the dense reference's (comparison `both`, same scale and budget), seed by seed, as
    (mean, std) over the paired seeds; `probe_delta_vs_dense_seeds` counts them. One seed's probe swings by
    more than the gap between depths (the probe's fifth round), so a margin is only read against this spread.
    The reference gets no row of its own zeros."""
    references = {k: probes for k, probes in _references(cells, _is_reference_run, lambda run: (run.scale,),
                                                         lambda run: run.probe).items() if all(probes.values())}
    for row in rows:
        group = cells[(row["cell"], row["budget"])]
        reference = None if _is_reference_run(group[0]) else references.get((group[0].scale, row["budget"]))
        paired = [r for r in group if reference and r.seed in reference and r.probe]
        keys = sorted(set.intersection(*(set(r.probe) & set(reference[r.seed]) for r in paired))) if paired else []
        row["probe_delta_vs_dense"] = {
            k: _mean_std([r.probe[k] - reference[r.seed][k] for r in paired])
            for k in keys if k.startswith(("probe_accuracy_k", "probe_answer_nll_k"))}
        row["probe_delta_vs_dense_seeds"] = len(paired) if row["probe_delta_vs_dense"] else 0


def is_dense_reference(variant: str, comparison: str) -> bool:
    """The cell every other is paired with: dense of comparison `both`. The probe's other dense cells (dense 3
    and 12) are compared with it like any other cell."""
    return variant == "dense" and comparison == "both"


def _is_reference_run(run: Run) -> bool:
    return is_dense_reference(run.variant, run.comparison)


def _references(cells, is_reference, key, value) -> dict[tuple, dict[int, Any]]:
    """{(*key, budget): {seed: value(run)}} of every reference cell (`is_reference` of its first run)."""
    return {(*key(g[0]), budget): {r.seed: value(r) for r in g}
            for (cell, budget), g in cells.items() if is_reference(g[0])}


def _paired(rows, cells, name: str, is_reference, key, pair_reference: bool) -> None:
    """`{name}_mean/_std/_seeds/_by_seed` on every row whose reference cell (`is_reference`, same `key` and
    budget) has runs of the same seeds. `pair_reference`: give the reference its own zero differences too."""
    references = _references(cells, is_reference, key, lambda run: run.best_valid)
    for row in rows:
        group = cells[(row["cell"], row["budget"])]
        skip = is_reference(group[0]) and not pair_reference
        reference = None if skip else references.get((*key(group[0]), row["budget"]))
        diffs = {r.seed: r.best_valid - reference[r.seed] for r in group if reference and r.seed in reference}
        row[f"{name}_mean"], row[f"{name}_std"] = _mean_std(list(diffs.values())) if diffs else (None, None)
        row[f"{name}_seeds"] = len(diffs)
        row[f"{name}_by_seed"] = diffs
