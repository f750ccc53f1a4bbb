"""The report's markdown: the cell table, loss vs R, gate diagnostics, MoR routing, Ouro's exits, ablations."""

from __future__ import annotations

import math

from grt_megatron.report.stats import PROBE_LEARNED_ACCURACY, is_dense_reference, probe_hops


def fmt_mean_std(mean: float, std: float) -> str:
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def _fmt_unfinished(row: dict) -> str:
    return f" ({row['unfinished']} unfinished)" if row["unfinished"] else ""


def _fmt_delta(row: dict, name: str = "delta_vs_dense") -> str:
    # The reference's own zeros are not shown; other dense cells (the probe's depth curve) are.
    if row[f"{name}_mean"] is None or is_dense_reference(row["variant"], row["comparison"]):
        return ""
    return _fmt_signed(row[f"{name}_mean"], row[f"{name}_std"], 4)


def _fmt_signed(mean: float, std: float, digits: int = 2) -> str:
    return f"{mean:+.{digits}f}" if math.isnan(std) else f"{mean:+.{digits}f} ± {std:.{digits}f}"


def cell_label(row: dict) -> str:
    """The cell's name, with its budget where it is not the 1× one."""
    return row["cell"] + ("" if row["budget"] == 1.0 else f" ({row['budget']:g}×)")


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def _gate_and_update(d: dict[str, float], r: int) -> str:
    """One cell of the gate and state-update table: "g / update" at recurrence r, "—" for a missing gate,
    empty where the run logged no update at r."""
    if f"relative_update_r{r}" not in d:
        return ""
    gate = f"{d[f'gate_mean_r{r}']:.3f}" if f"gate_mean_r{r}" in d else "—"
    return f"{gate} / {d[f'relative_update_r{r}']:.3f}"


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# Experiment report", "", f"Produced by `{command}`.", "",
             "Validation loss per token at the trained R with noise off, over each cell's seeds (mean ± sample "
             "std); best = lowest over the run's evaluations. FLOPs per token are training FLOPs (3 × forward; "
             "nominal at the configured R, executed = mean over the steps of the R each step ran).", "",
             "Parameters and FLOPs count every baseline's own pieces: RRT's per-recursion LoRA deltas, "
             "Ouro's exit head and, in its training FLOPs, the coda, LM head and exit head run at every step.", "",
             "Δ vs dense is the best validation loss minus the dense cell's of the same scale and budget, seed by "
             "seed (same data order and validation windows), mean ± std over the paired seeds.", "",
             "| cell | comparison | shape | params | FLOPs/token nominal | FLOPs/token executed | tokens | seeds "
             "| best val loss | final val loss | Δ vs dense |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {cell_label(r)} | {r['comparison']} | {r['shape']} | {_si(r['parameters'])} | "
            f"{_si(r['flops_per_token_nominal'])} | {_si(r['flops_per_token_executed'])} | {_si(r['tokens'])} | "
            f"{len(r['seeds'])}{_fmt_unfinished(r)} | "
            f"{fmt_mean_std(r['best_valid_mean'], r['best_valid_std'])} | "
            f"{fmt_mean_std(r['final_valid_mean'], r['final_valid_std'])} | {_fmt_delta(r)} |")
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
    # Every recurrent cell, gated or not: how far the state moves per recurrence is the comparison that tells
    # a GRT whose state stops after one step from an RRT or plain loop whose state keeps moving.
    recurrent = [r for r in rows if any(k.startswith("relative_update_r") for k in r["diagnostics"])
                 and (r["recurrences"] > 1 or any(k.startswith("gate_mean_r") for k in r["diagnostics"]))]
    if recurrent:
        depth = max(int(k.rsplit("_r", 1)[1]) for r in recurrent for k in r["diagnostics"]
                    if k.startswith(("gate_mean_r", "relative_update_r")))
        lines += ["", "## Gate and state update at the last evaluation", "",
                  "Per recurrence r: mean gate value g (or MoR's router weight; — where the model has no gate) / "
                  "relative state update ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ (over the validation windows, mean over "
                  "seeds). A gate that stays at its initial sigmoid(4) ≈ 0.982 has not learned.", "",
                  "| cell | " + " | ".join(f"r={k}" for k in range(1, depth + 1)) + " |", "|---|" + "---:|" * depth]
        for r in recurrent:
            lines.append(f"| {r['cell']} | " + " | ".join(_gate_and_update(r["diagnostics"], k)
                                                           for k in range(1, depth + 1)) + " |")
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
            others = [fmt_mean_std(*r["other_routing"][k]) for k in routed[0]["other_routing"]]
            active = [f"{r['diagnostics'][f'active_fraction_r{k}']:.2f}"
                      if f"active_fraction_r{k}" in r["diagnostics"] else "" for k in range(1, depth + 1)]
            lines.append(f"| {r['cell']} | {fmt_mean_std(r['best_valid_mean'], r['best_valid_std'])} | "
                         + " | ".join(others + active) + " |")
    lines += _exit_table(rows)
    lines += _probe_tables(rows)
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
            lines.append(f"| {cell_label(r)} | {r['shape']} | {_fmt_delta(r, 'delta_vs_grt')} | {seeds} |")
    lines += ["", "![validation loss curves](loss_curves.png)", ""]
    if any(r["variant"] != "dense" and r["delta_vs_dense_seeds"] for r in rows):
        lines += ["![difference to dense, seed by seed](delta_vs_dense.png)", ""]
    if swept:
        lines += ["![loss vs R at inference](loss_vs_r.png)", ""]
    if any(r.get("probe") for r in rows):
        lines += ["![depth probe: accuracy vs k](probe_accuracy.png)", ""]
    if any(len(r.get("probe_history") or {}) > 1 for r in rows):
        lines += ["![depth probe: accuracy over training](probe_curves.png)", ""]
    if any(len(r.get("probe_sweep") or {}) > 1 for r in rows):
        lines += ["![depth probe: accuracy vs R at inference](probe_vs_r.png)", ""]
    return "\n".join(lines)


def _exit_table(rows: list[dict]) -> list[str]:
    """Ouro: the loss at the last step against the exit rule, and where tokens exit."""
    looped = [r for r in rows if r.get("exit_rule")]
    if not looped:
        return []
    depth = max(r["recurrences"] for r in looped)
    lines = ["", "## Ouro: exit rule at evaluation", "",
             "The looped LM is reported at its last step (the tables above, a fixed R like every other model) and "
             "with its exit rule: each token scored at the first step where its cumulative exit probability reaches "
             "`model.exit_threshold`. Best validation loss under each (mean ± std over seeds); at the last "
             "evaluation, the mean exit step and, per step, the share of tokens exiting there / the mean exit "
             "probability p_r (mean over seeds).", "",
             "| cell | last step | exit rule | mean exit step | " + " | ".join(f"r={k}" for k in range(1, depth + 1))
             + " |", "|---|---:|---:|---:|" + "---:|" * depth]
    for r in looped:
        d = r["diagnostics"]
        per_step = [f"{d[f'exit_fraction_r{k}']:.2f} / {d[f'exit_probability_r{k}']:.2f}"
                    if f"exit_fraction_r{k}" in d and f"exit_probability_r{k}" in d else "" for k in range(1, depth + 1)]
        mean_step = f"{d['exit_mean_step']:.2f}" if "exit_mean_step" in d else ""
        lines.append(f"| {cell_label(r)} | {fmt_mean_std(r['best_valid_mean'], r['best_valid_std'])} | "
                     f"{fmt_mean_std(*r['exit_rule'])} | {mean_step} | " + " | ".join(per_step) + " |")
    return lines


def probe_hops_of(rows: list[dict]) -> list[int]:
    """The k values every probed cell scored."""
    probed = [r for r in rows if r.get("probe")]
    keys = set.intersection(*(set(r["probe"]) for r in probed)) if probed else set()
    return probe_hops(keys)


def _learned_at(row: dict) -> dict[int, list]:
    """A row's `probe_learned_at` by int k (summary.json's keys are strings)."""
    return {int(k): steps for k, steps in row["probe_learned_at"].items()}


def _probe_tables(rows: list[dict]) -> list[str]:
    """The depth probe (training/probe.py): answer accuracy and nll per k at the last evaluation, and the
    accuracy by inference R."""
    hops = probe_hops_of(rows)
    probed = [r for r in rows if r.get("probe")]
    if not hops:
        return []
    lines = ["", "## Depth probe", "",
             "Held-out examples of the synthetic task at each k (the number of dependent lookups the answer "
             "takes), at the last evaluation: exact-match accuracy of the answer (mean ± std over seeds) and, in "
             "brackets, the answer's nll in nats (mean). Cells in order of accuracy at the largest k.", "",
             "| cell | shape | seeds | " + " | ".join(f"k={k}" for k in hops) + " |", "|---|---|---:|" + "---:|" * len(hops)]
    top = f"probe_accuracy_k{hops[-1]}"
    for r in sorted(probed, key=lambda r: -r["probe"][top][0]):
        cells = [f"{fmt_mean_std(*r['probe'][f'probe_accuracy_k{k}'])} ({r['probe'][f'probe_answer_nll_k{k}'][0]:.2f})"
                 for k in hops]
        lines.append(f"| {cell_label(r)} | {r['shape']} | {len(r['seeds'])} | " + " | ".join(cells) + " |")
    learned = [r for r in probed if r.get("probe_learned_at")]
    ever = [k for k in hops if any(step is not None for r in learned for step in _learned_at(r).get(k, []))]
    if ever:
        never = [k for k in hops if k not in ever]
        lines += ["", "### When each k was learned", "",
                  f"The first evaluation step at which each seed's answer accuracy reached "
                  f"{PROBE_LEARNED_ACCURACY:.1f}, seeds in the order of the `seeds` column (— never). A cell whose "
                  "seeds split into learned and never has a mean that describes none of them."
                  + (f" No seed of any cell reached it at k = {', '.join(map(str, never))}." if never else ""), "",
                  "| cell | seeds | " + " | ".join(f"k={k}" for k in ever) + " |", "|---|---|" + "---:|" * len(ever)]
        for r in sorted(learned, key=lambda r: -r["probe"][top][0]):
            steps = _learned_at(r)
            cells = [" / ".join("—" if step is None else f"{step:,}" for step in steps[k]) if k in steps else ""
                     for k in ever]
            lines.append(f"| {cell_label(r)} | {', '.join(map(str, r['seeds']))} | " + " | ".join(cells) + " |")
    paired = [r for r in probed if r.get("probe_delta_vs_dense_seeds")]
    if paired:
        reference = next((r for r in probed if is_dense_reference(r["variant"], r["comparison"])), None)
        name = f" ({cell_label(reference)})" if reference else ""
        lines += ["", "### Depth probe against dense, seed by seed", "",
                  f"Each cell's accuracy minus the dense reference's{name} at the same seed (same batches), mean ± "
                  "std over the paired seeds, and, in brackets, the same for the answer's nll. A margin counts "
                  "where it is large against its std.", "",
                  "| cell | seeds | " + " | ".join(f"k={k}" for k in hops) + " |", "|---|---:|" + "---:|" * len(hops)]
        for r in sorted(paired, key=lambda r: -r["probe"][top][0]):
            delta = r["probe_delta_vs_dense"]
            cells = [_fmt_signed(*delta[f"probe_accuracy_k{k}"]) + f" ({delta[f'probe_answer_nll_k{k}'][0]:+.2f})"
                     if f"probe_accuracy_k{k}" in delta and f"probe_answer_nll_k{k}" in delta else "" for k in hops]
            lines.append(f"| {cell_label(r)} | {r['probe_delta_vs_dense_seeds']} | " + " | ".join(cells) + " |")
    swept = [r for r in probed if len(r.get("probe_sweep") or {}) > 1]
    if swept:
        depth = max(int(d) for r in swept for d in r["probe_sweep"])
        lines += ["", "### Depth probe vs recurrences at inference", "",
                  "Answer accuracy when the trained model runs R recurrences (mean over seeds); **bold** is the "
                  "trained R.", "", "| cell | k | " + " | ".join(f"R={d}" for d in range(1, depth + 1)) + " |",
                  "|---|---:|" + "---:|" * depth]
        for r in swept:
            sweep = {int(d): v for d, v in r["probe_sweep"].items()}
            for k in hops:
                cells = []
                for d in range(1, depth + 1):
                    v = sweep.get(d, {}).get(f"probe_accuracy_k{k}")
                    text = "" if v is None else f"{v:.3f}"
                    cells.append(f"**{text}**" if d == r["recurrences"] and text else text)
                lines.append(f"| {r['cell']} | {k} | " + " | ".join(cells) + " |")
    return lines
