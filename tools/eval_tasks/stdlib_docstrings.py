"""Two offline lm-eval tasks from the docstrings of Python's standard library, for `grt-eval --include-path`.

    python tools/eval_tasks/stdlib_docstrings.py --output evals/tasks
    grt-eval --checkpoint runs/demo --tasks stdlib_cloze,stdlib_ppl --include-path evals/tasks \
        --num-recurrences 1,2,4,8 --output evals/demo

The demo corpus is Python's language reference (`pydoc_topics`); the standard library's docstrings are
text of the same register that the model has not seen, so they measure held-out skill without a download.
- `stdlib_ppl` (loglikelihood_rolling): bits per byte, byte and word perplexity over whole docstrings.
- `stdlib_cloze` (multiple_choice): the first words of a docstring, then its true next 8 words against
  3 spans of 8 words from other docstrings (accuracy; chance 0.25).
The task YAMLs name their data by absolute path (lm-eval resolves `data_files` against the working
directory), so they are written, with the data, into `--output`. Same Python version, same files.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
import warnings
from pathlib import Path

MODULES = ["argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv",
           "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
           "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress",
           "itertools", "json", "logging", "lzma", "mailbox", "math", "mimetypes", "operator", "os",
           "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "sched", "secrets",
           "selectors", "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct",
           "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
           "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile"]
CONTEXT_WORDS, SPAN_WORDS, DISTRACTORS = 24, 8, 3


def docstrings(min_words: int) -> list[str]:
    """Distinct docstrings of at least `min_words` words, in a fixed order."""
    seen, out = set(), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            module = importlib.import_module(name)
            for _, obj in sorted(vars(module).items()):
                if getattr(obj, "__module__", None) != module.__name__:
                    continue
                doc = inspect.getdoc(obj)
                if doc and len(doc.split()) >= min_words and doc not in seen:
                    seen.add(doc)
                    out.append(" ".join(doc.split()))
    return out


def cloze_items(docs: list[str], count: int, rng: random.Random) -> list[dict]:
    items, split = [], [d.split() for d in docs]
    for i, words in enumerate(split[:count]):
        context, answer = words[:CONTEXT_WORDS], words[CONTEXT_WORDS:CONTEXT_WORDS + SPAN_WORDS]
        others = split[:i] + split[i + 1:]
        distractors = []
        for other in rng.sample(others, DISTRACTORS):
            start = rng.randrange(0, len(other) - SPAN_WORDS + 1)
            distractors.append(" ".join(other[start:start + SPAN_WORDS]))
        choices = [" " + " ".join(answer)] + [" " + d for d in distractors]
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append({"context": " ".join(context), "choices": [choices[k] for k in order],
                      "answer": order.index(0)})
    return items


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"# Written by tools/eval_tasks/stdlib_docstrings.py (Python {sys.version.split()[0]}).\n"
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")


CLOZE = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
PPL = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="folder for the task YAMLs and their data")
    parser.add_argument("--cloze-items", type=int, default=250)
    parser.add_argument("--ppl-docs", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    docs = docstrings(min_words=CONTEXT_WORDS + SPAN_WORDS)
    rng = random.Random(args.seed)
    rng.shuffle(docs)
    cloze = cloze_items(docs, args.cloze_items, rng)
    ppl = [{"text": d} for d in docs[len(cloze):len(cloze) + args.ppl_docs]]  # no document in both tasks
    for name, rows, body in (("stdlib_cloze", cloze, CLOZE), ("stdlib_ppl", ppl, PPL)):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(task_yaml(name, data, body))
        print(f"{name}: {len(rows)} documents -> {out / (name + '.yaml')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
