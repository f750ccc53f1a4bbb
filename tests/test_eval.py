"""grt-eval: lm-evaluation-harness on a checkpoint, offline, with the local tasks in tests/data/lm_eval_tasks
(one multiple-choice, one perplexity). Its scores at R = 1 and 3 equal those computed by hand with
grt-megatron's own model; bad input is one line and exit 2."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import LAUNCHER_VARIABLES, REPO, SHAKESPEARE, read_jsonl, run_cli

TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
QUIET = ["logging.wandb=disabled", "logging.progress=false"]
WINDOW = 64


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny GRT (1+1×3+1) with a 64-token window, trained 4 steps on Shakespeare (512-piece tokenizer)."""
    run = tmp_path_factory.mktemp("eval") / "run"
    proc = run_cli(["model=tiny", f"model.max_sequence_length={WINDOW}", "model.recurrences=3", f"data={SHAKESPEARE}",
                    "data.vocab_size=512", "train.iters=4", "train.global_batch_size=4", "train.micro_batch_size=4",
                    "train.eval_iters=1", *QUIET, f"run.dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The task YAMLs with their data files' absolute paths (datasets reads relative ones from the cwd),
    caching the prepared datasets beside them rather than in ~/.cache."""
    folder = tmp_path_factory.mktemp("tasks")
    for yaml in TASKS.glob("*.yaml"):
        text = yaml.read_text().replace("DATA_DIR", str(TASKS))
        text = text.replace("  data_files:", f"  cache_dir: {folder / 'cache'}\n  data_files:")
        (folder / yaml.name).write_text(text)
    return folder


def grt_eval_command(*args, cwd, modules=""):
    """(argv, env) of grt-eval in a process of its own."""
    # Not the launcher variables an in-process test of this pytest worker exported (MASTER_PORT is held
    # by its process group): accelerate, under lm-eval, would start a group on that taken port.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "HF_")) and k not in LAUNCHER_VARIABLES}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(cwd / "hf_home"))
    code = f"import sys; {modules}from grt_megatron.evaluation import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, *map(str, args)], env


def grt_eval(*args, cwd, modules=""):
    argv, env = grt_eval_command(*args, cwd=cwd, modules=modules)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


class Framework:
    """Log-likelihoods as lm-eval defines them, from grt-megatron's GRTLanguageModel and tokenizer."""

    def __init__(self, checkpoint):
        from grt_megatron.checkpoint.consolidate import consolidate
        from grt_megatron.checkpoint.store import inspect_checkpoint
        from grt_megatron.data.tokenizer import load_tokenizer
        from grt_megatron.model import GRTConfig, GRTLanguageModel

        tensors, _ = consolidate(checkpoint, progress=False)
        self.model = GRTLanguageModel(GRTConfig.from_recipe(inspect_checkpoint(checkpoint).state["model"]))
        self.model.load_state_dict(tensors, strict=True)
        self.model.eval()
        self.tok = load_tokenizer(checkpoint / "tokenizer.model")

    @torch.no_grad()
    def logprob(self, ids, first, r):
        """Sum of log p(ids[i] | ids[:i]) for i ≥ first, in one forward."""
        assert len(ids) <= WINDOW + 1
        logits = self.model(torch.tensor([ids[:-1]]), recurrences=r)[0, :, :self.tok.vocab_size].double()
        logp = torch.log_softmax(logits, -1)
        return sum(logp[i - 1, ids[i]].item() for i in range(first, len(ids)))

    def choice(self, context, continuation, r):
        """lm-eval encodes context + continuation and splits it after the context's tokens."""
        context_ids = self.tok.encode(context)
        whole = self.tok.encode(context + continuation)
        return self.logprob(whole, len(context_ids), r)

    def rolling(self, text, r):
        """Windows of WINDOW predictions after EOS (the prefix token), each seeing up to WINDOW tokens."""
        seq = [self.tok.eos_id, *self.tok.encode(text)]
        total, done, n = 0.0, 0, len(seq) - 1
        while done < n:
            end = min(done + WINDOW, n)
            start = max(0, end - WINDOW)
            total += self.logprob(seq[start:end + 1], done + 1 - start, r)
            done = end
        return total


def test_scores_at_two_depths_equal_the_framework(world, run_dir, tasks, tmp_path):
    out = tmp_path / "out"
    proc = grt_eval("--checkpoint", run_dir, "--tasks", "grt_test_choice,grt_test_rolling", "--num-recurrences",
                    "1,3", "--include-path", tasks, "--batch-size", "4", "--log-samples", "--output", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step_00000004"
    assert f"grt-eval: evaluating {checkpoint}\n" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "accuracy_vs_R.png", "results.md", "results_R1.json", "results_R3.json", "samples_R1_grt_test_choice.jsonl",
        "samples_R1_grt_test_rolling.jsonl", "samples_R3_grt_test_choice.jsonl", "samples_R3_grt_test_rolling.jsonl"]
    assert (out / "accuracy_vs_R.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert table in proc.stdout and "| task | metric | R=1 | R=3 |" in table
    assert "| grt_test_choice | acc | " in table and "| grt_test_rolling | word_perplexity | " in table

    framework = Framework(checkpoint)
    choice_docs, rolling_docs = read_jsonl(TASKS / "choice.jsonl"), read_jsonl(TASKS / "rolling.jsonl")
    assert max(len(framework.tok.encode(d["text"])) for d in rolling_docs) > 2 * WINDOW  # several windows
    scores = {}
    for r in (1, 3):
        results = json.loads((out / f"results_R{r}.json").read_text())
        assert results["grt"] == {"num_recurrences": r, "source": str(checkpoint), "trained_recurrences": 3}
        got = results["results"]
        samples = {s["doc_id"]: s for s in read_jsonl(out / f"samples_R{r}_grt_test_choice.jsonl")}
        right = right_norm = 0
        for i, doc in enumerate(choice_docs):
            want = [framework.choice(doc["context"], " " + c, r) for c in doc["choices"]]
            assert [ll for ll, _ in samples[i]["filtered_resps"]] == pytest.approx(want, rel=0, abs=1e-3)
            right += max(range(len(want)), key=want.__getitem__) == doc["answer"]
            norm = [ll / len(c) for ll, c in zip(want, doc["choices"])]
            right_norm += max(range(len(norm)), key=norm.__getitem__) == doc["answer"]
        assert got["grt_test_choice"]["acc,none"] == pytest.approx(right / len(choice_docs))
        assert got["grt_test_choice"]["acc_norm,none"] == pytest.approx(right_norm / len(choice_docs))
        lls = [framework.rolling(d["text"], r) for d in rolling_docs]
        words = sum(len(re.split(r"\s+", d["text"])) for d in rolling_docs)  # as lm-eval counts them
        nbytes = sum(len(d["text"].encode()) for d in rolling_docs)
        assert got["grt_test_rolling"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-5)
        assert got["grt_test_rolling"]["bits_per_byte,none"] == pytest.approx(-sum(lls) / nbytes / math.log(2),
                                                                               rel=1e-5)
        rolling = sorted(read_jsonl(out / f"samples_R{r}_grt_test_rolling.jsonl"), key=lambda s: s["doc_id"])
        assert [s["word_perplexity"][0] for s in rolling] == pytest.approx(lls, rel=0, abs=1e-3)
        scores[r] = lls
    # The depth reached the model: R 1 and 3 differ by 0.07 to 0.4 nats here, the two computations by < 1e-4.
    assert min(abs(a - b) for a, b in zip(scores[1], scores[3])) > 0.02


def test_bad_input_is_one_line_and_exit_2(run_dir, tasks, tmp_path):
    for args, message in [
        (["--checkpoint", tmp_path / "nope"], f"--checkpoint {tmp_path / 'nope'}: no such file or directory"),
        (["--checkpoint", tmp_path], f"--checkpoint {tmp_path}: no complete checkpoint in {tmp_path}"),
        (["--model-dir", tmp_path], f"--model-dir {tmp_path}: no config.json"),
    ]:
        proc = grt_eval(*args, "--tasks", "x", "--output", tmp_path / "out", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith(f"grt-eval: error: {message}"), proc.stderr
        assert proc.stderr.count("\n") == 1
    proc = grt_eval("--checkpoint", run_dir, "--tasks", "x", "--output", tmp_path / "out", cwd=tmp_path,
                    modules="sys.modules['lm_eval'] = None; ")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "grt-eval: error: lm-evaluation-harness is not installed: pip install grt-megatron[eval]\n"
    assert not (tmp_path / "out").exists()
    # Once a traceback (a limit <= 0, CUDA that is not there) or taken in silence (1.5 documents, -1 shots);
    # none leaves an --output folder behind.
    for args, message in [
        (["--limit", "0"], "--limit 0: a whole number of documents >= 1, or a fraction in (0, 1)"),
        (["--limit", "1.5"], "--limit 1.5: a whole number of documents >= 1, or a fraction in (0, 1)"),
        (["--num-fewshot", "-1"], "--num-fewshot -1: must be >= 0"),
        (["--device", "cuda"], "--device cuda: CUDA is not available on this machine"),
    ]:
        proc = grt_eval("--checkpoint", run_dir, "--tasks", "grt_test_choice", "--include-path", tasks, *args,
                        "--output", tmp_path / "out", cwd=tmp_path)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("grt-eval: error:")]
        assert proc.returncode == 2 and errors == [f"grt-eval: error: {message}"], proc.stderr[-2000:]
        assert not (tmp_path / "out").exists()


def test_sigterm_removes_the_temporary_export(run_dir, tasks, tmp_path):
    """A scheduler's SIGTERM while a checkpoint is evaluated used to leave OUTPUT/.grt-eval-export-* behind."""
    import signal
    import time

    out = tmp_path / "out"
    argv, env = grt_eval_command("--checkpoint", run_dir, "--tasks", "grt_test_choice", "--include-path", tasks,
                                 "--output", out, cwd=tmp_path)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(out.glob(".grt-eval-export-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, "grt-eval ended before its export could be seen"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "grt-eval: stopped by SIGTERM"
    assert not list(out.glob(".grt-eval-export-*"))


def test_unknown_tasks_are_refused_naming_close_ones(tasks, monkeypatch):
    import lm_eval.tasks

    from grt_megatron.evaluation import EvalError, task_manager

    # lm-eval's own ~15k task configs take ~20 s to index: here the index holds the local tasks only.
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, include_defaults=True:
                        real(include_path=include_path, include_defaults=False))
    assert "grt_test_rolling" in task_manager(["grt_test_choice", "grt_test_rolling"], str(tasks)).all_tasks
    with pytest.raises(EvalError, match=r"unknown task 'grt_test_choise' \(did you mean grt_test_choice"):
        task_manager(["grt_test_rolling", "grt_test_choise"], str(tasks))
    with pytest.raises(EvalError, match="--include-path /nonexistent: no such directory"):
        task_manager(["hellaswag"], "/nonexistent")
    # lm-eval skips a YAML it cannot parse: its task was "unknown" with unrelated suggestions, the file unnamed.
    (tasks / "broken.yaml").write_text("task: grt_test_broken\ndataset_path: [unclosed\n")
    try:
        with pytest.raises(EvalError, match=r"unknown task 'grt_test_broken'; a task file in --include-path does "
                                            r"not parse: .*broken\.yaml \(line 3: expected ','"):
            task_manager(["grt_test_broken"], str(tasks))
    finally:
        (tasks / "broken.yaml").unlink()


def test_an_exported_folder_at_its_trained_depth(run_dir, tasks, tmp_path, capsys):
    """--model-dir, in this process (lm-eval and torch are loaded already)."""
    from grt_megatron.evaluation import main
    from grt_megatron.hf.convert import export_checkpoint

    folder = export_checkpoint(run_dir / "checkpoints" / "step_00000004", tmp_path / "hf", progress=False)
    assert main(["--model-dir", str(folder), "--tasks", "grt_test_rolling", "--include-path", str(tasks),
                 "--limit", "2", "--output", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.md", "results_R3.json"]  # one R: no plot
    results = json.loads((tmp_path / "out" / "results_R3.json").read_text())
    assert results["grt"]["num_recurrences"] == 3 and results["n-samples"]["grt_test_rolling"]["effective"] == 2
    assert "| task | metric | R=3 |" in capsys.readouterr().out


def test_stdlib_docstring_tasks_are_well_formed(tmp_path):
    """tools/eval_tasks/stdlib_docstrings.py: the README's evaluation-at-several-R tasks. Each cloze item's
    answer is the docstring's true continuation, the two tasks share no document, lm-eval indexes both,
    and a second run writes the same files (the README's numbers can be reproduced)."""
    from lm_eval.tasks import TaskManager

    from tools.eval_tasks.stdlib_docstrings import CONTEXT_WORDS, SPAN_WORDS, docstrings, main

    assert main(["--output", str(tmp_path / "a"), "--cloze-items", "40", "--ppl-docs", "20"]) == 0
    assert main(["--output", str(tmp_path / "b"), "--cloze-items", "40", "--ppl-docs", "20"]) == 0
    for name in ("stdlib_cloze.jsonl", "stdlib_ppl.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    cloze = read_jsonl(tmp_path / "a" / "stdlib_cloze.jsonl")
    ppl = read_jsonl(tmp_path / "a" / "stdlib_ppl.jsonl")
    assert len(cloze) == 40 and len(ppl) == 20
    full = {tuple(d.split()[:CONTEXT_WORDS]): d for d in docstrings(CONTEXT_WORDS + SPAN_WORDS)}
    answers = [item["answer"] for item in cloze]
    assert len(set(answers)) > 1  # the true continuation is not always in the same place
    for item in cloze:
        doc = full[tuple(item["context"].split())]
        assert doc.startswith(item["context"] + item["choices"][item["answer"]])
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert all(len(c.split()) == SPAN_WORDS for c in item["choices"])
    contexts = {item["context"] for item in cloze}
    assert not any(" ".join(p["text"].split()[:CONTEXT_WORDS]) in contexts for p in ppl)
    manager = TaskManager(include_path=str(tmp_path / "a"), include_defaults=False)
    assert {"stdlib_cloze", "stdlib_ppl"} <= set(manager.all_tasks)
