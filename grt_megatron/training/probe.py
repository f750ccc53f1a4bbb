"""The depth probe during training: a synthetic task's held-out examples (data/synthetic.py) scored at every
validation and in the depth sweep, answer and prompt apart.

Per k in `probe.hops`, over `probe.examples` held-out examples:
- `probe_accuracy_kK`: the share of examples whose every answer token is the model's argmax (exact match,
  teacher-forced: a greedy decoder gives the same answer);
- `probe_answer_nll_kK`: −log P(answer | prompt) in nats per example (the sum over its answer tokens, so a
  tokenizer that splits " 4" into "▁" and "4" scores what a whole-token answer would);
- `probe_prompt_loss_kK`: the mean loss per prompt token (after the first), the language-model part.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from grt_megatron.data.synthetic import check_probe_corpus, probe_hops, resolve_task
from grt_megatron.device import device_tensor, device_zeros
from grt_megatron.model import ConfigError
from grt_megatron.model.layers import document_ids_of


class ProbeSet:
    """One k's examples as right-padded token rows and masks over the next-token labels (numpy, host)."""

    def __init__(self, hops: int, tokens: np.ndarray, answer: np.ndarray, prompt: np.ndarray):
        self.hops, self.tokens, self.answer, self.prompt = hops, tokens, answer, prompt


def encode_probe_set(examples, tokenizer, seq_length: int, hops: int, pad_multiple: int = 1) -> ProbeSet:
    """Token rows [n, L + 1]: EOS, then the example (L the longest rounded up to `pad_multiple`, padded with
    EOS), and masks [n, L] over the labels (row[1:]): where a label is an answer token, where a prompt token.
    The leading EOS puts the example where training sees every document, after an end of document (as
    lm-evaluation-harness prefixes a context with the EOT token); without it the first prompt token would sit
    at position 0, where no trained answer ever is. The answer's tokens must be the full text's tail after the
    prompt's: a tokenizer that merges across that boundary is refused. Right padding changes nothing before
    it (causal attention)."""
    rows, spans = [], []
    for ex in examples:
        prompt, full = tokenizer.encode(ex.prompt), tokenizer.encode(ex.text)
        if full[: len(prompt)] != prompt or len(full) == len(prompt):
            raise ConfigError(f"probe: the tokenizer {tokenizer.source} merges the prompt {ex.prompt[-12:]!r} "
                              f"with its answer {ex.answer!r}; the answer tokens cannot be told apart")
        if len(full) + 1 > seq_length + 1:
            raise ConfigError(f"probe: examples at k={hops} take {len(full) + 1} tokens with the EOS before them, "
                              f"more than train.seq_length + 1 = {seq_length + 1}: lower probe.hops or raise the "
                              "sequence length")
        rows.append([tokenizer.eos_id, *full])
        spans.append(len(prompt))
    width = -(-(max(len(r) for r in rows) - 1) // pad_multiple) * pad_multiple + 1
    if width > seq_length + 1:
        raise ConfigError(f"probe: examples at k={hops} padded to a multiple of {pad_multiple} take {width} tokens, "
                          f"more than train.seq_length + 1 = {seq_length + 1}")
    tokens = np.full((len(rows), width), tokenizer.eos_id, dtype=np.int64)
    answer = np.zeros((len(rows), width - 1), dtype=bool)
    prompt = np.zeros((len(rows), width - 1), dtype=bool)
    for i, (row, p) in enumerate(zip(rows, spans)):
        tokens[i, : len(row)] = row
        prompt[i, :p] = True  # labels 0 … p−1: the prompt's tokens (label j is row[j + 1])
        answer[i, p : len(row) - 1] = True  # labels p … end: the answer's tokens
    return ProbeSet(hops, tokens, answer, prompt)


class DepthProbe:
    """The probe sets of `probe.task` at each of `probe.hops`, and their metrics for a model."""

    def __init__(self, cfg, tokenizer, seq_length: int, pad_multiple: int = 1, prefixes=()):
        task = resolve_task(cfg.task)
        trained = check_probe_corpus(task, prefixes)
        hops = probe_hops(task, cfg.hops)
        self.sets = [encode_probe_set(task.validation(k, cfg.examples, trained), tokenizer, seq_length, k,
                                      pad_multiple) for k in hops]

    @torch.no_grad()
    def evaluate(self, runner, recurrences=None) -> dict[str, float]:
        """Every k's metrics for the runner's model at `recurrences` (None: the configured R). Data-parallel
        ranks take every dp-th example and sum on the device, so the numbers do not depend on the layout."""
        info, engine = runner.info, runner.engine
        engine.eval()
        out = {}
        try:
            for probe in self.sets:
                sums = device_zeros(4, dtype=torch.float64)  # answer nll, exact matches, prompt nll, prompt tokens
                mine = slice(info.dp_rank, None, info.dp_size)
                tokens, answer, prompt = probe.tokens[mine], probe.answer[mine], probe.prompt[mine]
                for start in range(0, len(tokens), runner.micro_batch):
                    rows = device_tensor(tokens[start : start + runner.micro_batch], dtype=torch.int64)
                    a = device_tensor(answer[start : start + runner.micro_batch], dtype=torch.bool)
                    p = device_tensor(prompt[start : start + runner.micro_batch], dtype=torch.bool)
                    inputs = rows[:, :-1].contiguous()
                    documents = document_ids_of(inputs, runner.document_eos)
                    logits = engine(inputs, None, recurrences, document_ids=documents).float()
                    labels = rows[:, 1:]
                    nll = -F.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
                    hit = (logits.argmax(-1) == labels) | ~a
                    sums += torch.stack([(nll * a).sum().double(), hit.all(-1).sum().double(),
                                         (nll * p).sum().double(), p.sum().double()])
                if info.dp_size > 1:
                    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
                n = len(probe.tokens)
                answer_nll, exact, prompt_nll, prompt_tokens = sums.tolist()
                out[f"probe_accuracy_k{probe.hops}"] = exact / n
                out[f"probe_answer_nll_k{probe.hops}"] = answer_nll / n
                out[f"probe_prompt_loss_k{probe.hops}"] = prompt_nll / max(prompt_tokens, 1.0)
        finally:
            engine.train()
        return out
