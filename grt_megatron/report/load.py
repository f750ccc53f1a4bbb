"""Reading run directories: `run_info.json` and `metrics.jsonl` into a `Run` per run."""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


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
    exit_rule: Optional[float] = None
    """Ouro: the best validation loss under its exit rule (`loss_exit_rule`; `valid` is the last step's)."""
    other_routing: dict[str, float] = field(default_factory=dict)
    """MoR: the best validation loss under its other evaluation routing (`loss_topk_routing` or
    `loss_threshold_routing`), besides `loss` under the run's own."""
    probe: dict[str, float] = field(default_factory=dict)
    """The depth probe at the last evaluation (`probe_accuracy_kK`, `probe_answer_nll_kK`, ...)."""
    probe_sweep: dict[int, dict[str, float]] = field(default_factory=dict)
    """The depth probe by inference R (the depth sweep)."""
    probe_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(step, the depth probe) at every evaluation: when, in training, each k was learned."""

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


_NUMBERS = ("step", "tokens", "loss", "recurrences", "flops_per_token", "flops_per_s", "tokens_per_s",
            "loss_exit_rule")
_NUMBER_PREFIXES = ("gate_mean_r", "relative_update_r", "active_fraction_r", "exit_", "probe_")


def _read_as_number(key: str) -> bool:
    """The record fields `load_run` reads as numbers (others, e.g. a step's `loss_spike: true`, are not)."""
    return key in _NUMBERS or key.startswith(_NUMBER_PREFIXES) or (key.startswith("loss_") and
                                                                     key.endswith("_routing"))


def _read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err})") from None
    except UnicodeDecodeError as err:
        raise ReportError(f"{path}: not UTF-8 text (byte {err.start}): not a metrics.jsonl") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ReportError(f"{path}:{number}: not a JSON record: {line[:60]!r}") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ReportError(f"{path}:{number}: a metrics record needs a 'step' field")
        for key, value in record.items():  # what the report reads as a number; null is a non-finite value
            if _read_as_number(key) and not (
                    value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))):
                raise ReportError(f"{path}:{number}: {key!r} is {value!r}, not a number")
        records.append(record)
    return records


def _probe_metrics(record: dict) -> dict[str, float]:
    """An evaluation record's depth-probe metrics (training/probe.py); empty without a probe."""
    return {k: _number(v) for k, v in record.items() if k.startswith("probe_")}


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
    exit_rule, probe, probe_sweep, probe_history = None, {}, {}, []
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
                           if k.startswith(("gate_mean_r", "relative_update_r", "active_fraction_r", "exit_"))}
            probe = _probe_metrics(r)
            if probe:
                probe_history.append((int(r["step"]), probe))
            if r.get("loss_exit_rule") is not None:
                exit_rule = min(_number(r["loss_exit_rule"]), math.inf if exit_rule is None else exit_rule)
            for k, v in r.items():
                if k.startswith("loss_") and k.endswith("_routing"):
                    other_routing[k] = min(_number(v), other_routing.get(k, math.inf))
        elif split == "depth_sweep":
            sweep[int(r["recurrences"])] = _number(r["loss"])
            if probe_at_r := _probe_metrics(r):
                probe_sweep[int(r["recurrences"])] = probe_at_r
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
        diagnostics=diagnostics, other_routing=other_routing, exit_rule=exit_rule, probe=probe,
        probe_sweep=probe_sweep, probe_history=probe_history, finished=max(int(r["step"]) for r in records) >= int(
            (config.get("train") or {}).get("iters", 0)),
    )


def find_runs(paths: list[Path]) -> list[Run]:
    return load_runs(find_run_dirs(paths))


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """The run directories named or held by `paths` (the filesystem only: quick, before any heavy import)."""
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
    return list(dict.fromkeys(dirs))


def load_runs(dirs: list[Path]) -> list[Run]:
    """Each run directory's run; one without an evaluation yet is skipped, saying so."""
    runs = []
    for d in dirs:
        run = load_run(d)
        if run is None:
            print(f"grt-report: skipping {d}: no evaluation yet", file=sys.stderr)
        else:
            runs.append(run)
    return runs
