"""Synthetic depth probes: tasks whose difficulty is a number k of sequential steps, which a model of fixed
depth can only do with enough layers (or recurrences). A task is a corpus source like any other:

    grt-prepare-data --input synthetic:chains:hops=1-4,examples=50000 \\
        --tokenizer data/books_1k.tokenizer.model --output-prefix data/chains_1k

and the same spec names the held-out validation examples that training evaluates (`probe.task`,
training/probe.py), at the training k and beyond it.

`chains` (variable binding): `chains` chains of k bindings each over distinct one-letter variables; a chain's
first binding is a digit, each later one names the chain's previous variable; all bindings are shuffled
together; the query names the last variable of one chain, and the answer is that chain's digit:

    j = 4 ; q = j ; x = 7 ; f = q ; b = x ; w = b ; ? f = 4          (k = 3, chains = 2: f → q → j → 4)

Reading the answer takes k dependent lookups (the query's variable, then the variable it names, ...), each an
attention step that needs the previous one's result, so the depth a model needs grows with k. The chains
share one length and distinct digits, so neither the length nor the digit gives the answer away.

Examples are a pure function of (task options, stream, index): `train` examples 0 … examples−1 form the
corpus (with `queries` > 1, each document asks further variables after the scored query); validation
examples (the scored query alone) come from the `valid` stream, with any prompt that also occurs in the training
corpus dropped, so a validation score is never a memorised training example.
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from grt_megatron.data.sources import SYNTHETIC, DataError

VARIABLES = string.ascii_lowercase + string.ascii_uppercase


class ChainStyle(NamedTuple):
    """How a chains document is written: its symbols, the form of a binding and of a query, and the pattern
    whose group 1 finds every answer in a document (a query's value with the space before it, as the probe
    scores `ProbeExample.answer`: the tokens after the prompt's; the `data.loss_on=answers` mask)."""

    variables: str
    values: str
    binding: str
    query: str
    answer: re.Pattern
    separator: str = " ; "
    """Between bindings."""


STYLES = {
    # `equals` is the readable form of the module docstring; `pairs` writes a binding as two symbols, `q j`,
    # and a query as `? f` followed by the answer, values being capitals A-J: every symbol one token for a
    # tokenizer trained on the task, so a lookup is the plain induction pattern (find the earlier `f`, copy
    # the token after it) instead of a match two tokens back across an ` =` every binding shares.
    "equals": ChainStyle(VARIABLES, "0123456789", "{} = {}", " ; ? {} =",
                         re.compile(r"\?\s*\S+?\s*=(\s*\d+)")),
    "pairs": ChainStyle(string.ascii_lowercase, "ABCDEFGHIJ", "{} {}", " ; ? {}",
                        re.compile(r"\?\s*[a-z](\s*[A-J])")),
    # `fused` writes a binding as one word, `qj` (one token for a tokenizer trained on the task, vocabulary
    # 1,400; 1,024 and 1,200 split some): a lookup is then one attention step (the query `q` finds the token whose left half is q and
    # reads its right half), with no previous-token head to form first; k hops need k such steps, each
    # reading what the one before found, so the layers (or recurrences) needed grow with k.
    "fused": ChainStyle(string.ascii_lowercase, "ABCDEFGHIJ", "{}{}", " ? {}",
                        re.compile(r"\?\s*[a-z](\s*[A-J])"), separator=" "),
}


@dataclass(frozen=True)
class ProbeExample:
    """One problem: the model reads `prompt` and should continue it with `answer`."""

    prompt: str
    answer: str
    hops: int
    more: str = ""
    """The training document's further queries with their answers (`queries` > 1), after the scored one."""

    @property
    def text(self) -> str:
        """The scored problem: prompt and answer (the probe's example)."""
        return self.prompt + self.answer


@dataclass(frozen=True)
class ChainsTask:
    """Variable-binding chains (module docstring). `hops`: the range k is drawn from, uniformly, for the
    training corpus; `chains`: chains per example (one queried, the others distractors); `queries`: up to
    this many queries per training document (at most one per variable): the first asks a chain's last
    variable (k lookups, the one the probe scores), the others ask random variables (fewer lookups, or one
    when an earlier answer already names it); more answers per token make the lookups faster to learn."""

    hops: tuple[int, int] = (1, 4)
    chains: int = 2
    examples: int = 20000
    seed: int = 0
    queries: int = 1
    style: str = "equals"
    name = "chains"

    @property
    def answer_pattern(self) -> re.Pattern:
        """Group 1 is an answer, in any document of the task (`ChainStyle.answer`)."""
        return STYLES[self.style].answer

    def __post_init__(self) -> None:
        lo, hi = self.hops
        if not 1 <= lo <= hi:
            raise DataError(f"synthetic:chains: hops={lo}-{hi} must be 1 <= low <= high")
        if not 1 <= self.chains <= 10:
            raise DataError(f"synthetic:chains: chains={self.chains} must be 1 … 10 (each chain has its own digit)")
        if self.examples < 1:
            raise DataError(f"synthetic:chains: examples={self.examples} must be >= 1")
        if self.queries < 1:
            raise DataError(f"synthetic:chains: queries={self.queries} must be >= 1")
        if self.style not in STYLES:
            raise DataError(f"synthetic:chains: style={self.style} is not one of {', '.join(STYLES)}")
        self.check_hops(hi)

    def check_hops(self, hops: int) -> None:
        names = STYLES[self.style].variables
        if hops < 1 or hops * self.chains > len(names):
            raise DataError(f"synthetic:chains: k={hops} with chains={self.chains} needs {hops * self.chains} "
                            f"distinct variables; there are {len(names)} ({names[0]}-{names[-1]}"
                            f"{', A-Z' if len(names) > 26 else ''}) in style={self.style}")

    def example(self, stream: str, index: int, hops: int | None = None) -> ProbeExample:
        """Example `index` of `stream` (`train` or `valid`), at `hops` (default: drawn from `self.hops`)."""
        rng = random.Random(f"chains/{self.seed}/{stream}/{index}")
        k = rng.randint(*self.hops) if hops is None else hops
        self.check_hops(k)
        style = STYLES[self.style]
        names = rng.sample(style.variables, self.chains * k)
        digits = [style.values[d] for d in rng.sample(range(10), self.chains)]
        bindings = []
        for c in range(self.chains):
            chain = names[c * k : (c + 1) * k]
            bindings.append((chain[0], str(digits[c])))
            bindings.extend((chain[i], chain[i - 1]) for i in range(1, k))
        rng.shuffle(bindings)
        query = rng.randrange(self.chains)
        prompt = style.separator.join(style.binding.format(left, right) for left, right in bindings)
        prompt += style.query.format(names[query * k + k - 1])
        more = ""
        if self.queries > 1:  # drawn after everything above, so queries=1 gives the same examples as before
            others = [i for i in range(self.chains * k) if i != query * k + k - 1]
            for i in rng.sample(others, min(self.queries, self.chains * k) - 1):
                more += f"{style.query.format(names[i])} {digits[i // k]}"
        return ProbeExample(prompt, f" {digits[query]}", k, more)

    def documents(self) -> Iterator[str]:
        """The training corpus: one example a document (the tokenizer's EOS closes each)."""
        for index in range(self.examples):
            ex = self.example("train", index)
            yield ex.text + ex.more

    def validation(self, hops: int, count: int, also_trained: Sequence["ChainsTask"] = ()) -> list[ProbeExample]:
        """`count` held-out examples at exactly `hops`: none of whose prompts is in the training corpus, nor
        in that of `also_trained` (the other corpora of a blend, `check_probe_corpus`)."""
        self.check_hops(hops)
        seen: frozenset[str] = frozenset()
        for corpus in {self, *also_trained}:
            lo, hi = corpus.hops
            if lo <= hops <= hi:
                seen = seen | _training_prompts(corpus)
        out, index = [], 0
        while len(out) < count:
            ex = self.example("valid", index, hops)
            index += 1
            if ex.prompt not in seen:
                out.append(ex)
            if index > 100 * count:
                raise DataError(f"synthetic:chains: fewer than {count} held-out examples exist at k={hops} "
                                "(the training corpus covers the task): use more chains or fewer examples")
        return out


def resolve_task(value: str) -> ChainsTask:
    """A task from a spec (`synthetic:chains:...`) or from a prefix grt-prepare-data wrote from one (its
    `PREFIX.meta.json` names the spec, so the probe and the corpus cannot disagree on the options)."""
    if value.startswith(SYNTHETIC):
        return parse_synthetic(value)
    meta = Path(f"{value}.meta.json")
    if not meta.is_file():
        raise DataError(f"{value!r} is neither a synthetic:NAME[:options] spec nor a prepared prefix "
                        f"({meta} does not exist)")
    inputs, specs = _prefix_inputs(meta)
    if len(specs) != 1:
        raise DataError(f"{meta}: the prefix was prepared from {inputs}, not from exactly one synthetic task")
    return parse_synthetic(specs[0])


def _prefix_inputs(meta: Path) -> tuple[list, list[str]]:
    """A prefix's `meta.json` inputs, and those of them that are synthetic specs."""
    try:
        inputs = json.loads(meta.read_text())["inputs"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{meta}: not a grt-prepare-data meta file (no inputs list)") from None
    return inputs, [i for i in inputs if isinstance(i, str) and i.startswith(SYNTHETIC)]


def synthetic_spec_of_prefix(prefix: str) -> str | None:
    """The synthetic spec a prepared prefix was made from alone, if it was (None for any other corpus)."""
    try:
        inputs, specs = _prefix_inputs(Path(f"{prefix}.meta.json"))
    except (OSError, DataError):
        return None
    return specs[0] if len(specs) == 1 == len(inputs) else None


def check_probe_corpus(task: ChainsTask, prefixes) -> list[ChainsTask]:
    """The training corpora of the probe's task name (the probe holds its examples out of all of them).
    Refused: a probe task that is none of them (its examples would be held out from another corpus than the
    one trained on), and a blend of them in other formats (style, chains) than the probe scores. A blend of
    the same format at other hops or query counts is a curriculum: e.g. one-hop chains beside 1-4 hops."""
    corpora = {}
    for prefix in prefixes:
        spec = synthetic_spec_of_prefix(prefix)
        corpus = None if spec is None else parse_synthetic(spec)
        if corpus is not None and corpus.name == task.name:
            corpora[prefix] = (spec, corpus)
    if corpora and task not in [corpus for _, corpus in corpora.values()]:
        prefix, (spec, _) = next(iter(corpora.items()))
        raise DataError(f"probe.task {task} differs from the task {prefix} was prepared from ({spec}): the "
                        f"probe's examples are held out from the corpus trained on only when they agree; "
                        f"set probe.task={prefix}")
    for prefix, (spec, corpus) in corpora.items():
        if (corpus.style, corpus.chains) != (task.style, task.chains):
            raise DataError(f"data.prefixes blend {prefix} ({spec}) with probe.task {task}: a blend's synthetic "
                            "corpora must share the probe's style and chains (the format it scores)")
    return [corpus for _, corpus in corpora.values()]


def probe_hops(task: ChainsTask, requested=()) -> list[int]:
    """The k values a probe scores: `requested`, or the training range and twice its top (length
    generalisation), each checked against the task."""
    lo, hi = task.hops
    hops = sorted(set(requested)) or sorted({*range(lo, hi + 1), 2 * hi})
    for k in hops:
        task.check_hops(k)
    return hops


@functools.lru_cache(maxsize=4)
def _training_prompts(task: ChainsTask) -> frozenset[str]:
    """The training corpus's prompts (about 7 s for 50,000 examples: once per task, not per k)."""
    return frozenset(task.example("train", i).prompt for i in range(task.examples))


def answer_token_mask(rows: np.ndarray, token_texts: Sequence[str], eos_id: int, pattern: re.Pattern) -> np.ndarray:
    """rows [n, s + 1] of token ids (inputs and the next token) -> [n, s] float32 weights of the label
    positions: 1 where the label is a token of an answer (`pattern`'s group 1) of a document that starts in
    the row, else 0. The row's first document is left out: it starts before the row, so its queries may
    have lost the bindings that answer them (a loss on those would be noise)."""
    n, width = rows.shape
    out = np.zeros((n, width - 1), dtype=np.float32)
    for i, row in enumerate(rows):
        starts = np.flatnonzero(row == eos_id) + 1
        for a, b in zip(starts, [*starts[1:], width]):
            texts = [token_texts[t] for t in row[a:b]]
            lengths = np.array([len(t) for t in texts])
            ends = np.cumsum(lengths)
            begins = ends - lengths
            text = "".join(texts)
            for match in pattern.finditer(text):
                lo, hi = match.span(1)
                hit = np.flatnonzero((begins < hi) & (ends > lo))
                out[i, a + hit - 1] = 1.0  # label position t predicts token t + 1
    return out


TASKS = {"chains": ChainsTask}


def _range(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition("-")
    return int(lo), int(hi or lo)


_OPTIONS = {"hops": _range, "chains": int, "examples": int, "seed": int, "queries": int, "style": str}


def parse_synthetic(spec: str) -> ChainsTask:
    """`synthetic:NAME[:key=value,...]` (the `synthetic:` prefix optional) -> the task. Bad names, options or
    values raise DataError naming them."""
    body = spec[len(SYNTHETIC):] if spec.startswith(SYNTHETIC) else spec
    name, _, options = body.partition(":")
    if name not in TASKS:
        raise DataError(f"input {spec!r}: unknown synthetic task {name!r} (known: {', '.join(sorted(TASKS))})")
    kwargs = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key not in _OPTIONS or not eq:
            raise DataError(f"input {spec!r}: {item!r} is not key=value with key one of {', '.join(_OPTIONS)}")
        try:
            kwargs[key] = _OPTIONS[key](value)
        except ValueError:
            raise DataError(f"input {spec!r}: {key}={value!r} is not "
                            f"{'a range like 1-4' if key == 'hops' else 'an integer'}") from None
    return TASKS[name](**kwargs)
