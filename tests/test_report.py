"""`grt-report` on small hand-written runs: the table's numbers, the plots, bad input."""

import json
import statistics
import subprocess
import sys

import pytest

from grt_megatron.report import ReportError, find_runs, summarize, write_report

MODEL = dict(hidden_size=64, num_attention_heads=4, vocab_size=300, max_sequence_length=32, prelude_layers=1,
             core_layers=1, coda_layers=1, recurrences=3, add_bias_linear=False)


def fake_run(path, cell, seed, valid, sweep=None, comparison="isoflops", model=None, valid_extra=None,
             sweep_extra=None, gate=True):
    path.mkdir(parents=True)
    model = {**MODEL, **(model or {})}
    (path / "run_info.json").write_text(json.dumps({
        "config": {"seed": seed, "train": {"seq_length": 32, "iters": 30},
                   "experiment": {"name": cell, "scale": "cpu", "budget": 1.0, "comparison": comparison,
                                  "variant": cell}},
        "model": model, "model_shape": "1+1x3+1", "parameters": 12345}))
    lines = []
    for step, loss in enumerate(valid, 1):
        lines.append({"step": 10 * step, "loss": loss + 0.1, "tokens": 10 * step * 64, "flops_per_token": 1000.0 * step,
                      "tokens_per_s": 1.0, "flops_per_s": 1.0})
        lines.append({"step": 10 * step, "split": "valid", "loss": loss, "relative_update_r1": 0.5,
                      **({"gate_mean_r1": 0.9 + 0.01 * seed} if gate else {}),
                      **(valid_extra(step, loss) if valid_extra else {})})
    for r, loss in (sweep or {}).items():
        lines.append({"step": 10 * len(valid), "split": "depth_sweep", "recurrences": r, "loss": loss,
                      **(sweep_extra(r) if sweep_extra else {})})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_report_table_and_plots(tmp_path):
    fake_run(tmp_path / "runs/a/s1", "grt", 1, [5.0, 4.0, 4.2], {1: 4.5, 2: 4.1, 3: 4.0, 4: 4.05})
    fake_run(tmp_path / "runs/a/s2", "grt", 2, [5.0, 4.1, 4.0], {1: 4.7, 2: 4.3, 3: 4.2, 4: 4.25})
    fake_run(tmp_path / "runs/b/s1", "dense", 1, [5.1, 4.5, 4.3], comparison="both",
             model=dict(prelude_layers=0, core_layers=5, coda_layers=0, recurrences=1, gate="none", injection="none"))
    fake_run(tmp_path / "runs/b/s2", "dense", 2, [5.1, 4.4, 3.9], comparison="both",
             model=dict(prelude_layers=0, core_layers=5, coda_layers=0, recurrences=1, gate="none", injection="none"))
    fake_run(tmp_path / "runs/c/s1", "no_noise", 1, [5.0, 4.05, 4.1])
    fake_run(tmp_path / "runs/c/s2", "no_noise", 2, [5.0, 4.3, 4.02])
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "grt_megatron.report", str(tmp_path / "runs"), "--output",
                             str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows = {r["cell"]: r for r in json.loads((out / "summary.json").read_text())}
    assert rows["grt"]["seeds"] == [1, 2] and rows["dense"]["seeds"] == [1, 2]
    # Paired by seed: 4.0 - 4.3 and 4.0 - 3.9.
    assert rows["grt"]["delta_vs_dense_mean"] == pytest.approx(-0.1)
    assert rows["grt"]["delta_vs_dense_std"] == pytest.approx(statistics.stdev([-0.3, 0.1]))
    assert rows["grt"]["best_valid_mean"] == pytest.approx(4.0)  # min per run: 4.0 and 4.0
    assert rows["grt"]["final_valid_mean"] == pytest.approx(4.1)
    assert rows["grt"]["final_valid_std"] == pytest.approx(statistics.stdev([4.2, 4.0]))
    assert rows["grt"]["flops_per_token_executed"] == pytest.approx(2000.0)  # mean over steps of 1k, 2k, 3k
    assert rows["grt"]["depth_sweep"] == {"1": pytest.approx(4.6), "2": pytest.approx(4.2),
                                          "3": pytest.approx(4.1), "4": pytest.approx(4.15)}
    assert rows["grt"]["tokens"] == 1920 and rows["grt"]["parameters"] == 12345
    assert rows["grt"]["unfinished"] == 0
    report = (out / "report.md").read_text()
    assert "| grt | isoflops | 1+1x3+1 | 12.35 k |" in report
    assert "4.1000 ± 0.1414" in report and "| -0.1000 ± 0.2828 |" in report
    assert "**4.1000**" in report and "**4.1500**" not in report  # the trained R (3) is bold
    assert report.index("| grt |") < report.index("| dense |")  # ordered by best validation loss
    assert "| grt | 0.915 / 0.500 |" in report  # the last evaluation's gate, mean over the two seeds
    assert rows["grt"]["delta_vs_dense_by_seed"] == {"1": pytest.approx(-0.3), "2": pytest.approx(0.1)}
    # Ablations are also paired with the GRT of their comparison: 4.05 - 4.0 and 4.02 - 4.0.
    assert rows["no_noise"]["delta_vs_grt_by_seed"] == {"1": pytest.approx(0.05), "2": pytest.approx(0.02)}
    assert rows["no_noise"]["delta_vs_grt_mean"] == pytest.approx(0.035)
    assert rows["grt"]["delta_vs_grt_seeds"] == 0 and rows["dense"]["delta_vs_grt_seeds"] == 0
    assert "| no_noise | 1+1x3+1 | +0.0350 ± 0.0212 | 1: +0.0500, 2: +0.0200 |" in report
    for png in ("loss_curves.png", "loss_vs_r.png", "delta_vs_dense.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(out.glob(".*.tmp"))

    # Any subset of the cells: the dense run alone has no depth sweep, and no stale loss-vs-R plot is kept.
    write_report(find_runs([tmp_path / "runs/b"]), out, "test")
    assert not (out / "loss_vs_r.png").exists() and not (out / "delta_vs_dense.png").exists()
    assert "| dense |" in (out / "report.md").read_text()


def test_report_shows_the_state_update_of_recurrent_cells_without_a_gate(tmp_path):
    update = lambda step, loss: {"relative_update_r2": 0.25, "relative_update_r3": 0.1 * step}  # noqa: E731
    fake_run(tmp_path / "runs/grt/s1", "grt", 1, [4.4, 4.1], valid_extra=update)
    fake_run(tmp_path / "runs/rrt/s1", "rrt", 1, [4.5, 4.2], gate=False, valid_extra=update)
    fake_run(tmp_path / "runs/dense/s1", "dense", 1, [4.3, 4.0], gate=False, comparison="both",
             model=dict(prelude_layers=0, core_layers=5, coda_layers=0, recurrences=1, gate="none", injection="none"))
    write_report(find_runs([tmp_path / "runs"]), tmp_path / "report", "test")
    table = (tmp_path / "report/report.md").read_text().split("## Gate and state update")[1].split("##")[0]
    assert "| rrt | — / 0.500 | — / 0.250 | — / 0.200 |" in table  # the last evaluation's update, no gate
    assert "| grt | 0.910 / 0.500 | — / 0.250 | — / 0.200 |" in table  # a recurrence without a gate value
    assert "| dense |" not in table  # one layer stack run once has no recurrence to report


def test_report_shows_mor_under_both_routings(tmp_path):
    for seed, top_k in ((1, [4.0, 3.5]), (2, [4.2, 3.7])):
        fake_run(tmp_path / f"runs/mor/s{seed}", "mor", seed, [4.5, 4.0],
                 valid_extra=lambda step, loss, top_k=top_k: {
                     "loss_topk_routing": top_k[step - 1], "active_fraction_r1": 1.0,
                     "active_fraction_r2": 0.5 + 0.1 * step})
    fake_run(tmp_path / "runs/grt/s1", "grt", 1, [4.4, 4.1])
    rows = {r["cell"]: r for r in summarize(find_runs([tmp_path / "runs"]))}
    assert rows["grt"]["other_routing"] == {}
    mean, std = rows["mor"]["other_routing"]["loss_topk_routing"]  # best per run: 3.5 and 3.7
    assert mean == pytest.approx(3.6) and std == pytest.approx(statistics.stdev([3.5, 3.7]))
    write_report(find_runs([tmp_path / "runs"]), tmp_path / "report", "test")
    report = (tmp_path / "report/report.md").read_text()
    assert "## MoR: routing at evaluation" in report
    assert "| mor | 4.0000 ± 0.0000 | 3.6000 ± 0.1414 | 1.00 | 0.70 |" in report
    assert "| grt | 4.1000 |" not in report.split("## MoR")[1]


def _probe(acc1, acc4):
    return {"probe_accuracy_k1": acc1, "probe_answer_nll_k1": 1.0 - acc1, "probe_prompt_loss_k1": 2.0,
            "probe_accuracy_k4": acc4, "probe_answer_nll_k4": 2.0 - acc4, "probe_prompt_loss_k4": 2.1}


def test_report_shows_the_depth_probe_by_k_and_by_r(tmp_path):
    # The last evaluation counts (not the best): step 3's values.
    for seed, last in ((1, (0.9, 0.5)), (2, (0.8, 0.3))):
        fake_run(tmp_path / f"runs/grt/s{seed}", "grt", seed, [5.0, 4.0, 4.1], {1: 4.5, 2: 4.1, 3: 4.0},
                 valid_extra=lambda step, loss, last=last: _probe(*last) if step == 3 else _probe(0.1, 0.0),
                 sweep_extra=lambda r, seed=seed: _probe(0.2 * r, 0.1 * r + 0.01 * seed))
        fake_run(tmp_path / f"runs/dense/s{seed}", "dense", seed, [5.1, 4.5, 4.3], comparison="both",
                 model=dict(prelude_layers=0, core_layers=5, coda_layers=0, recurrences=1, gate="none",
                            injection="none"), valid_extra=lambda step, loss: _probe(0.6, 0.1))
        # A shallower dense cell of the depth curve: compared with the dense reference like any other cell.
        fake_run(tmp_path / f"runs/dense3/s{seed}", "dense3", seed, [5.2, 4.6, 4.4], comparison="depth",
                 model=dict(prelude_layers=0, core_layers=3, coda_layers=0, recurrences=1, gate="none",
                            injection="none"), valid_extra=lambda step, loss, seed=seed: _probe(0.5, 0.05 * seed))
    out = tmp_path / "report"
    rows = {r["cell"]: r for r in write_report(find_runs([tmp_path / "runs"]), out, "test")}
    assert rows["grt"]["probe"]["probe_accuracy_k4"] == (pytest.approx(0.4), pytest.approx(statistics.stdev([0.5, 0.3])))
    assert rows["grt"]["probe"]["probe_answer_nll_k1"][0] == pytest.approx(0.15)
    assert rows["grt"]["probe_sweep"][3]["probe_accuracy_k4"] == pytest.approx(0.315)  # 0.31 and 0.32
    assert rows["dense"]["probe_sweep"] == {}
    # Over training: every evaluation's probe, mean and std over the seeds (steps 10, 20, 30).
    history = rows["grt"]["probe_history"]
    assert sorted(history) == [10, 20, 30] and history[10]["probe_accuracy_k4"] == (0.0, 0.0)
    assert history[30]["probe_accuracy_k1"] == (pytest.approx(0.85), pytest.approx(statistics.stdev([0.9, 0.8])))
    # When each k was learned, per seed: the first evaluation at accuracy >= 0.9. grt seed 1 reaches k = 1 at
    # step 30 (0.9), seed 2 never (0.8 at most); dense never; no cell learns k = 4.
    assert rows["grt"]["probe_learned_at"] == {1: [30, None], 4: [None, None]}
    assert rows["dense"]["probe_learned_at"] == {1: [None, None], 4: [None, None]}
    report = (out / "report.md").read_text()
    assert "### When each k was learned" in report and "| grt | 1, 2 | 30 / — |" in report
    assert "No seed of any cell reached it at k = 4." in report and "| dense | 1, 2 | — / — |" in report
    assert "## Depth probe" in report and "| cell | shape | seeds | k=1 | k=4 |" in report
    assert "| grt | 1+1x3+1 | 2 | 0.8500 ± 0.0707 (0.15) | 0.4000 ± 0.1414 (1.60) |" in report
    assert report.index("| grt | 1+1x3+1 | 2 |") < report.index("| dense | 1+1x3+1 | 2 |")  # by accuracy at k=4
    assert "| grt | 4 | 0.115 | 0.215 | **0.315** |" in report
    # Against the dense reference seed by seed: grt k=1 0.9 − 0.6 and 0.8 − 0.6, k=4 0.5 − 0.1 and 0.3 − 0.1;
    # the nll (1 − acc and 2 − acc here) moves the other way. The reference has no row of zeros.
    assert rows["grt"]["probe_delta_vs_dense"]["probe_accuracy_k4"] == (
        pytest.approx(0.3), pytest.approx(statistics.stdev([0.4, 0.2])))
    assert rows["dense"]["probe_delta_vs_dense"] == {} and rows["dense3"]["probe_delta_vs_dense_seeds"] == 2
    assert "### Depth probe against dense, seed by seed" in report and "reference's (dense)" in report
    assert "| grt | 2 | +0.25 ± 0.07 (-0.25) | +0.30 ± 0.14 (-0.30) |" in report
    assert "| dense3 | 2 | -0.10 ± 0.00 (+0.10) | -0.03 ± 0.04 (+0.03) |" in report
    assert "| dense | 2 | +0.00" not in report
    # The depth curve's other dense cells show their loss difference to the reference; the reference does not.
    assert rows["dense3"]["delta_vs_dense_mean"] == pytest.approx(0.1)
    assert "| +0.1000 ± 0.0000 |" in report
    assert "(probe_curves.png)" in report
    for png in ("probe_accuracy.png", "probe_curves.png", "probe_vs_r.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_report(find_runs([tmp_path / "runs/dense"]), out, "test")  # no sweep: no stale plot kept
    assert (out / "probe_accuracy.png").exists() and not (out / "probe_vs_r.png").exists()


BAD_PATH_IMPORTS = """
import json, sys
from grt_megatron import report
try:
    report.main(sys.argv[1:])
except SystemExit as stop:
    print(json.dumps({"status": stop.code, "imported": [m for m in ("matplotlib", "megatron") if m in sys.modules]}))
"""


def test_report_names_the_bad_file(tmp_path):
    fake_run(tmp_path / "running", "grt", 1, [])  # no evaluation yet: left out, not an error
    assert find_runs([tmp_path / "running"]) == []
    fake_run(tmp_path / "run", "grt", 1, [5.0])
    with (tmp_path / "run/metrics.jsonl").open("a") as f:
        f.write("{not json\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:3: not a JSON record"):
        find_runs([tmp_path / "run"])
    # The CLI checks the paths before it imports matplotlib and megatron (seconds on a cold start).
    result = subprocess.run([sys.executable, "-c", BAD_PATH_IMPORTS, str(tmp_path / "nothing"), "--output",
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.stderr.strip().splitlines() == [f"grt-report: error: {tmp_path / 'nothing'}: no such run directory"]
    assert json.loads(result.stdout) == {"status": 2, "imported": []}
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="holds no run"):
        find_runs([tmp_path / "empty"])
    # These were tracebacks: a value that is not a number, bytes that are not text, and runs none of which
    # has an evaluation yet (which also left an empty --output folder behind).
    fake_run(tmp_path / "text", "grt", 1, [5.0])
    (tmp_path / "text/metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "loss_spike": true}\n'  # not read: fine
                                                 '{"step": 1, "loss": "abc"}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: 'loss' is 'abc', not a number"):
        find_runs([tmp_path / "text"])
    (tmp_path / "text/metrics.jsonl").write_bytes(b"\x93\x94abc")
    with pytest.raises(ReportError, match=r"metrics.jsonl: not UTF-8 text \(byte 0\)"):
        find_runs([tmp_path / "text"])
    result = subprocess.run([sys.executable, "-c", BAD_PATH_IMPORTS, str(tmp_path / "running"), "--output",
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] == (f"grt-report: error: no run among {tmp_path / 'running'} "
                                                      "has an evaluation yet")
    assert json.loads(result.stdout)["status"] == 2 and not (tmp_path / "out").exists()
    assert summarize([]) == []
