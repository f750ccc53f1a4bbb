"""The depth probe: the synthetic `chains` task (determinism, answers that follow from the bindings, held-out
validation, one-line refusals), the answer-token metrics on hand-made logits, and the probe inside real
training runs, mixed with another corpus, equal in one process and in DP 2."""

import math
import re
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, read_jsonl, run_cli, run_prepare

from grt_megatron.data import DataError, load_tokenizer
from grt_megatron.data.synthetic import ChainsTask, check_probe_corpus, parse_synthetic, probe_hops, resolve_task

QUIET = ["logging.wandb=disabled", "logging.progress=false"]


def _solve(prompt: str) -> tuple[str, int]:
    """The answer and the number of bindings read, by following the query's chain back to its digit."""
    body, query = prompt.rsplit(" ; ? ", 1)
    bindings = dict(b.split(" = ") for b in body.split(" ; "))
    name, read = query.removesuffix(" ="), 0
    while not name.isdigit():
        name, read = bindings[name], read + 1
    return name, read


def test_chains_are_deterministic_and_every_answer_follows_from_the_bindings():
    task = parse_synthetic("synthetic:chains:hops=1-4,examples=50000")
    assert task == ChainsTask(hops=(1, 4), chains=2, examples=50000, seed=0)
    # Pinned: a change of the generator would silently change every corpus and probe made with it.
    assert task.example("train", 0).text == "H = I ; V = q ; q = 5 ; I = 4 ; ? H = 4"
    assert list(parse_synthetic("synthetic:chains:examples=300").documents()) == \
        list(parse_synthetic("synthetic:chains:examples=300").documents())
    assert list(parse_synthetic("synthetic:chains:examples=50,seed=1").documents()) != \
        list(parse_synthetic("synthetic:chains:examples=50").documents())
    three = parse_synthetic("synthetic:chains:hops=2-6,chains=3,examples=400")
    seen_hops = set()
    for i in range(400):
        ex = three.example("train", i)
        answer, read = _solve(ex.prompt)
        assert ex.answer == f" {answer}" and read == ex.hops, ex.text
        statements = ex.prompt.split(" ; ")[:-1]
        assert len(statements) == 3 * ex.hops  # three chains of k bindings, one digit each
        digits = [s.split(" = ")[1] for s in statements if s.split(" = ")[1].isdigit()]
        assert len(digits) == len(set(digits)) == 3
        seen_hops.add(ex.hops)
    assert seen_hops == {2, 3, 4, 5, 6}


def _check_capital_answers(task, ex, bindings: dict, query: str, asks: str) -> None:
    """The capital-valued styles: the scored answer (after exactly k lookups) and every further query's
    follow the bindings, and the answer mask's pattern finds every answer, the scored one first."""
    name, read = query, 0
    while not name.isupper():
        name, read = bindings[name], read + 1
    assert ex.answer == f" {name}" and read == ex.hops
    for asked in ex.more.split(asks)[1:]:
        other, value = asked.split(" ")
        while not other.isupper():
            other = bindings[other]
        assert value == other
    found = task.answer_pattern.findall(ex.text + ex.more)
    assert found[0] == ex.answer and len(found) == 1 + ex.more.count("?")


def test_pairs_style_writes_every_binding_as_two_symbols_and_answers_follow_the_chain():
    task = parse_synthetic("synthetic:chains:hops=1-5,chains=3,examples=300,queries=4,style=pairs")
    assert parse_synthetic("synthetic:chains:hops=1-5,chains=3,examples=300,queries=4").example("train", 3) != \
        task.example("train", 3)
    assert list(task.documents()) == list(parse_synthetic(
        "synthetic:chains:hops=1-5,chains=3,examples=300,queries=4,style=pairs").documents())
    for i in range(300):
        ex = task.example("train", i)
        body, query = ex.prompt.rsplit(" ; ? ", 1)
        bindings = dict(b.split(" ") for b in body.split(" ; "))
        assert all(len(k) == 1 and k.islower() for k in bindings)
        _check_capital_answers(task, ex, bindings, query, " ; ? ")
    with pytest.raises(DataError, match=re.escape("k=14 with chains=2 needs 28 distinct variables; there are 26 (a-z)")):
        parse_synthetic("synthetic:chains:hops=14,style=pairs")
    with pytest.raises(DataError, match=re.escape("style=arrows is not one of equals, pairs, fused")):
        parse_synthetic("synthetic:chains:style=arrows")


def test_fused_style_writes_every_binding_as_one_word_and_answers_follow_the_chain():
    task = parse_synthetic("synthetic:chains:hops=1-8,chains=2,examples=300,queries=3,style=fused")
    # Pinned, as the other styles' first example.
    assert task.example("train", 1).text == "jH wD ? w D"
    for i in range(300):
        ex = task.example("train", i)
        body, query = ex.prompt.rsplit(" ? ", 1)
        words = body.split(" ")
        assert len(words) == 2 * ex.hops and all(len(w) == 2 and w[0].islower() for w in words)
        _check_capital_answers(task, ex, {w[0]: w[1] for w in words}, query, " ? ")


def test_more_queries_ask_other_variables_after_the_same_scored_problem():
    one = parse_synthetic("synthetic:chains:hops=1-4,examples=200")
    many = parse_synthetic("synthetic:chains:hops=1-4,examples=200,queries=8")
    for i in range(200):
        a, b = one.example("train", i), many.example("train", i)
        assert a.text == b.text and a.more == ""  # the scored problem is unchanged
        asked = b.more.split(" ; ? ")[1:]
        assert len(asked) == min(8, 2 * b.hops) - 1
        names = [q.split(" = ")[0] for q in asked]
        assert len(set(names)) == len(names) and b.prompt.rsplit("? ", 1)[1][:-2] not in names
        for q in asked:  # each further answer follows from the bindings
            name, digit = q.split(" = ")
            assert digit == _solve(b.prompt.rsplit(" ; ? ", 1)[0] + f" ; ? {name} =")[0], b.text + b.more
    docs = list(many.documents())
    assert docs[0] == many.example("train", 0).text + many.example("train", 0).more


def test_validation_is_held_out_at_exactly_k_and_past_the_training_range():
    task = parse_synthetic("synthetic:chains:hops=1-2,examples=5000")
    train = {task.example("train", i).prompt for i in range(task.examples)}
    for k in (1, 2, 5):
        valid = task.validation(k, 200)
        assert len(valid) == 200 and {ex.hops for ex in valid} == {k}
        assert not train & {ex.prompt for ex in valid}
        assert all(ex.answer == f" {_solve(ex.prompt)[0]}" for ex in valid)
    assert probe_hops(task) == [1, 2, 4] and probe_hops(task, [3, 1]) == [1, 3]
    # k = 1 with one chain has 52 variables × 10 digits = 520 prompts: a corpus of 5,000 covers them all.
    with pytest.raises(DataError, match="fewer than 10 held-out examples exist at k=1"):
        parse_synthetic("synthetic:chains:hops=1-1,chains=1,examples=5000").validation(1, 10)


@pytest.mark.parametrize("spec, message", [
    ("synthetic:sums", "unknown synthetic task 'sums' (known: chains)"),
    ("synthetic:chains:depth=3", "'depth=3' is not key=value with key one of hops, chains, examples, seed, queries"),
    ("synthetic:chains:hops=a-b", "hops='a-b' is not a range like 1-4"),
    ("synthetic:chains:hops=4-2", "hops=4-2 must be 1 <= low <= high"),
    ("synthetic:chains:hops=1-30", "k=30 with chains=2 needs 60 distinct variables; there are 52"),
    ("synthetic:chains:chains=11", "chains=11 must be 1 … 10"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(DataError, match=re.escape(message)):
        parse_synthetic(spec)


def test_prepare_writes_the_task_and_the_prefix_names_it(pydoc_prefix, tmp_path):
    tokenizer = f"{pydoc_prefix[0]}.tokenizer.model"
    spec = "synthetic:chains:hops=1-3,examples=500,seed=7"
    proc = run_prepare(["--input", spec, "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "chains"),
                        "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "500 documents" in proc.stdout
    assert resolve_task(str(tmp_path / "chains")) == parse_synthetic(spec)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data, tok = IndexedDataset(str(tmp_path / "chains")), load_tokenizer(tokenizer)
    assert len(data) == 500
    first = [int(t) for t in data[0]]
    assert first[-1] == tok.eos_id and tok.decode(first[:-1]) == parse_synthetic(spec).example("train", 0).text
    bad = run_prepare(["--input", "synthetic:chains:hops=9", "--input", "synthetic:chainz", "--tokenizer", tokenizer,
                       "--output-prefix", str(tmp_path / "bad"), "--no-progress"])
    assert bad.returncode != 0 and "unknown synthetic task 'chainz'" in bad.stderr
    assert not list(tmp_path.glob("bad*"))
    check_probe_corpus(parse_synthetic(spec), [str(pydoc_prefix[0]), str(tmp_path / "chains")])  # they agree
    with pytest.raises(DataError, match=re.escape(f"differs from the task {tmp_path / 'chains'} was prepared from")):
        check_probe_corpus(parse_synthetic("synthetic:chains:hops=1-3,examples=500"), [str(tmp_path / "chains")])
    # A curriculum blend (the same format at other hops): the probe holds its examples out of both corpora.
    one_hop = "synthetic:chains:hops=1,examples=3000,seed=7"
    assert run_prepare(["--input", one_hop, "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "one"),
                        "--no-progress"]).returncode == 0
    trained = check_probe_corpus(parse_synthetic(spec), [str(tmp_path / "one"), str(tmp_path / "chains")])
    assert trained == [parse_synthetic(one_hop), parse_synthetic(spec)]
    alone = {ex.prompt for ex in parse_synthetic(spec).validation(1, 300)}
    blended = {ex.prompt for ex in parse_synthetic(spec).validation(1, 300, trained)}
    one_hop_prompts = {parse_synthetic(one_hop).example("train", i).prompt for i in range(3000)}
    assert alone & one_hop_prompts and not blended & one_hop_prompts  # the blend's prompts are held out too
    with pytest.raises(DataError, match="must share the probe's style and chains"):
        run_prepare(["--input", "synthetic:chains:hops=1,examples=50,style=pairs", "--tokenizer", tokenizer,
                     "--output-prefix", str(tmp_path / "pairs"), "--no-progress"])
        check_probe_corpus(parse_synthetic(spec), [str(tmp_path / "pairs"), str(tmp_path / "chains")])
    with pytest.raises(DataError, match="not from exactly one synthetic task"):
        resolve_task(str(pydoc_prefix[0]))
    with pytest.raises(DataError, match="neither a synthetic:NAME"):
        resolve_task(str(tmp_path / "missing"))


class _Oracle(torch.nn.Module):
    """Hand-made logits for a probe set: `answer_logit` on the true token at answer positions, `prompt_logit`
    on it at prompt positions, 0 elsewhere; `wrong_second` puts the answer's second token's mass on another
    token (the first right, the whole answer wrong)."""

    def __init__(self, probe, vocab, answer_logit=0.0, prompt_logit=0.0, wrong_second=False):
        super().__init__()
        self.probe, self.vocab = probe, vocab
        self.answer_logit, self.prompt_logit, self.wrong_second = answer_logit, prompt_logit, wrong_second

    def forward(self, tokens, labels, recurrences, document_ids=None):
        assert labels is None
        rows = torch.as_tensor(self.probe.tokens)
        index = [int(torch.nonzero((rows[:, : tokens.shape[1]] == t).all(-1))[0]) for t in tokens]
        out = torch.zeros(*tokens.shape, self.vocab)
        for b, i in enumerate(index):
            targets = rows[i, 1:]
            answer = np.flatnonzero(self.probe.answer[i])
            for pos in range(tokens.shape[1]):
                value = self.answer_logit if self.probe.answer[i, pos] else \
                    self.prompt_logit if self.probe.prompt[i, pos] else 0.0
                wrong = self.wrong_second and pos == answer[-1]
                out[b, pos, (int(targets[pos]) + 1) % self.vocab if wrong else int(targets[pos])] = value
        return out


class _Runner:
    def __init__(self, engine, micro_batch=3):
        self.engine, self.micro_batch, self.document_eos = engine, micro_batch, None
        self.info = type("Info", (), {"dp_rank": 0, "dp_size": 1})()


def test_answer_metrics_on_hand_made_logits(pydoc_prefix):
    from grt_megatron.training.probe import DepthProbe, encode_probe_set

    tok = load_tokenizer(f"{pydoc_prefix[0]}.tokenizer.model")
    task = parse_synthetic("synthetic:chains:hops=1-2,examples=100")
    examples = task.validation(2, 7)
    probe = encode_probe_set(examples, tok, seq_length=64, hops=2, pad_multiple=4)
    assert (probe.tokens.shape[1] - 1) % 4 == 0
    for i, ex in enumerate(examples):
        prompt, full = tok.encode(ex.prompt), tok.encode(ex.text)
        assert probe.tokens[i, 0] == tok.eos_id  # the example follows an end of document, as in training
        labels = probe.tokens[i, 1:]
        assert list(labels[probe.answer[i]]) == full[len(prompt):]  # exactly the answer's tokens
        assert list(labels[probe.prompt[i]]) == prompt  # the prompt's
    n_answer = probe.answer.sum(1)
    assert (n_answer >= 1).all()
    vocab = tok.vocab_size
    metrics = DepthProbe.__new__(DepthProbe)
    metrics.sets = [probe]

    def run(**oracle):
        return metrics.evaluate(_Runner(_Oracle(probe, vocab, **oracle)))

    # The metrics are computed in fp32 (as the loss is): equal to the closed forms to fp32's rounding.
    uniform = run()  # every token log V; argmax of equal logits is token 0, never an answer here
    assert uniform["probe_accuracy_k2"] == 0.0
    assert uniform["probe_answer_nll_k2"] == pytest.approx(n_answer.mean() * math.log(vocab), rel=1e-6, abs=1e-5)
    assert uniform["probe_prompt_loss_k2"] == pytest.approx(math.log(vocab), rel=1e-6)
    sure = run(answer_logit=10.0, prompt_logit=2.0)
    per_token = math.log1p((vocab - 1) * math.exp(-10.0))
    assert sure["probe_accuracy_k2"] == 1.0
    assert sure["probe_answer_nll_k2"] == pytest.approx(n_answer.mean() * per_token, rel=1e-6, abs=1e-5)
    assert sure["probe_prompt_loss_k2"] == pytest.approx(math.log1p((vocab - 1) * math.exp(-2.0)), rel=1e-6, abs=1e-5)
    if (n_answer > 1).all():  # a tokenizer that splits " 4" in two: one right token is not a right answer
        assert run(answer_logit=10.0, wrong_second=True)["probe_accuracy_k2"] == 0.0


def test_probe_in_training_mixed_with_a_corpus_equal_in_one_process_and_dp2(pydoc_prefix, tmp_path):
    prefix = tmp_path / "chains"
    proc = run_prepare(["--input", "synthetic:chains:hops=1-2,examples=2000", "--tokenizer",
                        f"{pydoc_prefix[0]}.tokenizer.model", "--output-prefix", str(prefix), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    common = ["model=tiny", "data=indexed", f"data.prefixes=[{pydoc_prefix[0]},{prefix}]", "data.weights=[0.5,0.5]",
              "train.iters=4", "train.eval_interval=2", "train.eval_iters=1", "train.global_batch_size=4",
              "train.micro_batch_size=2", "train.depth_sweep=1", f"probe.task={prefix}", "probe.examples=12", *QUIET]
    runs = {}
    for name, launcher in (("one", None), ("dp2", [sys.executable, "-m", "torch.distributed.run",
                                                   "--nproc_per_node=2", "--master_port=29871"])):
        run_dir = tmp_path / name
        proc = run_cli([*common, f"run.dir={run_dir}"], launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = read_jsonl(run_dir / "metrics.jsonl")
    valid = [r for r in runs["one"] if r.get("split") == "valid"]
    assert [r["step"] for r in valid] == [2, 4]
    keys = [f"probe_{m}_k{k}" for k in (1, 2, 4) for m in ("accuracy", "answer_nll", "prompt_loss")]
    for record in valid:
        assert all(math.isfinite(record[key]) for key in keys), record
        assert all(0.0 <= record[f"probe_accuracy_k{k}"] <= 1.0 for k in (1, 2, 4))
    sweep = [r for r in runs["one"] if r.get("split") == "depth_sweep"]
    assert [r["recurrences"] for r in sweep] == [1, 2, 3, 4, 5] and all(set(keys) <= set(r) for r in sweep)
    assert sweep[0]["probe_answer_nll_k2"] != sweep[-1]["probe_answer_nll_k2"]  # R reaches the probe
    evals = {name: [r for r in records if r.get("split") in ("valid", "depth_sweep")]
             for name, records in runs.items()}
    assert len(evals["dp2"]) == len(evals["one"]) == 7
    for got, want in zip(evals["dp2"], evals["one"]):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_probe_settings_are_checked_with_the_run(pydoc_prefix):
    from hydra import compose, initialize_config_dir

    from grt_megatron.model import ConfigError
    from grt_megatron.training.config import build_run_config

    def build(*overrides, world_size=1):
        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
            cfg = compose("train", overrides=["model=tiny", "data=indexed", f"data.prefixes=[{pydoc_prefix[0]}]",
                                              *overrides])
        return build_run_config(cfg, world_size=world_size)

    assert build("probe.task='synthetic:chains:hops=1-2'", "probe.hops=[1,3]").probe.hops == [1, 3]
    for overrides, message in (
            (["probe.task=synthetic:chainz"], "probe.task: input 'synthetic:chainz': unknown synthetic task"),
            (["probe.task='synthetic:chains:hops=1-2'", "probe.hops=[40]"], "k=40 with chains=2 needs 80"),
            (["probe.task='synthetic:chains'", "probe.examples=0"], "probe.examples must be >= 1, got 0"),
            ([f"probe.task={pydoc_prefix[0]}"], "not from exactly one synthetic task")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            build(*overrides)
    with pytest.raises(ConfigError, match=re.escape("probe.task is not supported with parallel.pp > 1")):
        build("probe.task='synthetic:chains'", "parallel.pp=2", "deepspeed.zero_stage=1", world_size=2)


def test_answer_mask_marks_exactly_the_answers_of_documents_that_start_in_the_row(pydoc_prefix):
    from grt_megatron.data.synthetic import answer_token_mask

    tok = load_tokenizer(f"{pydoc_prefix[0]}.tokenizer.model")
    task = parse_synthetic("synthetic:chains:hops=1-3,examples=100,queries=4")
    docs = [task.example("train", i) for i in range(6)]
    ids, answers = [], []
    for ex in docs:
        ids += tok.encode(ex.text + ex.more) + [tok.eos_id]
        # every query's digit: the scored one, then those of `more`
        answers.append([ex.answer.strip(), *re.findall(r"\? \S+ = (\d)", ex.more)])
    texts = tok.token_texts()  # each id's text, spaces included: they join back into the document
    joined = "".join(texts[i] for i in tok.encode(docs[0].text + docs[0].more))
    assert joined.removeprefix(" ") == docs[0].text + docs[0].more  # sentencepiece adds a dummy " " first
    cut = 5  # the row starts inside the first document: its answers are not scored
    row = np.array([ids[cut:]])
    mask = answer_token_mask(row, tok.token_texts(), tok.eos_id, task.answer_pattern)
    assert mask.shape == (1, row.shape[1] - 1) and set(np.unique(mask)) <= {0.0, 1.0}
    marked = "".join(tok.decode([int(row[0, t + 1])]) for t in np.flatnonzero(mask[0]))
    assert marked == "".join(d for doc in answers[1:] for d in doc)  # every answer after the first document
    # the probe's answer tokens (the text's after the prompt's: " 4" may be two), for every answer
    per_answer = len(tok.encode(docs[1].text)) - len(tok.encode(docs[1].prompt))
    assert mask.sum() == per_answer * sum(len(doc) for doc in answers[1:])
    # each marked label comes after its query's " =": the mask lines up with the labels
    for t in np.flatnonzero(mask[0]):
        assert tok.decode([int(i) for i in row[0, : t + 1]]).rstrip().endswith("=")
    # a row without a document start scores nothing
    assert answer_token_mask(row[:, :20], tok.token_texts(), tok.eos_id, task.answer_pattern).sum() == 0


def test_answer_loss_trains_equal_in_one_process_dp2_and_accumulation(pydoc_prefix, tmp_path):
    prefix = tmp_path / "chains"
    proc = run_prepare(["--input", "synthetic:chains:hops=1-2,examples=2000,queries=4", "--tokenizer",
                        f"{pydoc_prefix[0]}.tokenizer.model", "--output-prefix", str(prefix), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    common = ["model=tiny", "data=indexed", f"data.prefixes=[{prefix}]", f"data.tokenizer={pydoc_prefix[0]}.tokenizer.model",
              "train.iters=3", "train.eval_interval=3",
              "train.eval_iters=1", "train.global_batch_size=4", "train.depth_sweep=null", *QUIET]
    runs = {}
    for name, extra, launcher in (
            ("all", ["train.micro_batch_size=4"], None),
            ("one", ["train.micro_batch_size=4", "data.loss_on=answers"], None),
            ("accumulated", ["train.micro_batch_size=1", "data.loss_on=answers"], None),
            ("dp2", ["train.micro_batch_size=1", "data.loss_on=answers"],
             [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29873"])):
        run_dir = tmp_path / name
        proc = run_cli([*common, *extra, f"run.dir={run_dir}"], launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = read_jsonl(run_dir / "metrics.jsonl")

    def losses(name):
        return [r["loss"] for r in runs[name] if "split" not in r or r["split"] == "valid"]

    # micro-batches hold different numbers of answers: only a mean over the global batch's answers makes the
    # layouts agree (a mean per micro-batch would not)
    for name in ("accumulated", "dp2"):
        assert losses(name) == pytest.approx(losses("one"), rel=1e-5), name
    # the answer tokens' loss is another number than every token's: at the first step (measured: 7.644 against
    # 7.556) and in validation after training on it (6.566 against 6.847); in between the two curves cross
    one, every = losses("one"), losses("all")
    assert abs(one[0] - every[0]) > 0.03 and abs(one[-1] - every[-1]) > 0.1


def test_answer_loss_is_refused_where_answers_are_unknown(pydoc_prefix, tmp_path):
    from hydra import compose, initialize_config_dir

    from grt_megatron.model import ConfigError
    from grt_megatron.training.config import build_run_config

    proc = run_cli(["model=tiny", "data=indexed", f"data.prefixes=[{pydoc_prefix[0]}]", "data.loss_on=answers",
                    "train.iters=1", f"run.dir={tmp_path / 'books'}", *QUIET])
    assert proc.returncode != 0
    assert f"data.loss_on=answers: {pydoc_prefix[0]} was not prepared from a synthetic task alone" in proc.stderr

    def build(*overrides, world_size=1):
        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
            cfg = compose("train", overrides=["model=tiny", "data=indexed", f"data.prefixes=[{pydoc_prefix[0]}]",
                                              *overrides])
        return build_run_config(cfg, world_size=world_size)

    with pytest.raises(ConfigError, match=re.escape("data.loss_on='prompts' is not one of all, answers")):
        build("data.loss_on=prompts")
    with pytest.raises(ConfigError, match=re.escape("data.loss_on=answers is not supported with parallel.pp > 1")):
        build("data.loss_on=answers", "parallel.pp=2", "deepspeed.zero_stage=1", world_size=2)
