"""Ouro-style looped language model (`exit_head`): a loss at every recurrence step, weighted by a learned
exit distribution (Zhu et al., "Scaling Latent Reasoning via Looped Language Models", stage I).

    y_t = FinalNorm(Coda(h_t))                       t = 1 … R (h_t = Core(h_{t-1}), no gate, no injection)
    lambda_t = sigmoid(w · y_t + c)                  the exit head, per token
    p_t = lambda_t · prod_{j<t} (1 − lambda_j)       p_R = prod_{j<R} (1 − lambda_j): the last step takes the rest
    loss = sum_t p_t · CE_t − beta · H(p)            H(p) = −sum_t p_t log p_t

Exit probabilities are computed in log space (log-sigmoids and their running sum), so a distribution with
tiny early exits keeps its exact entropy. Outside training a token is scored at the last step
(`exit_rule="last"`: a fixed R, what the other models report) or at its exit step, the first t where
sum_{j<=t} p_j reaches `exit_threshold` (`exit_rule="threshold"`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from grt_megatron.model.init import piece_rng

EXIT_RULES = ("last", "threshold")


def build_exit_head(config, init_seed: int) -> torch.nn.Linear:
    """Linear(d, 1) with a bias, its weight drawn like the model's other linears and its bias 0: every
    lambda_t starts near 0.5, so the exit distribution starts near (1/2, 1/4, …, the rest)."""
    with piece_rng(init_seed, "exit_head"):
        head = torch.nn.Linear(config.hidden_size, 1, bias=True, dtype=config.params_dtype, device="cpu")
        config.init_method(head.weight)
        with torch.no_grad():
            head.bias.zero_()
    return head


def exit_log_probs(exit_logits: torch.Tensor) -> torch.Tensor:
    """exit logits [R, ...] (fp32) -> log p_t [R, ...]: log lambda_t + sum_{j<t} log(1 − lambda_j), the last
    step log prod_{j<R}(1 − lambda_j)."""
    log_exit, log_stay = F.logsigmoid(exit_logits), F.logsigmoid(-exit_logits)
    survived = torch.cumsum(log_stay, 0) - log_stay  # log prod_{j<t}(1 − lambda_j), exclusive
    return torch.cat([log_exit[:-1] + survived[:-1], survived[-1:]])


def looped_loss(ce: torch.Tensor, log_p: torch.Tensor, entropy_coeff: float) -> torch.Tensor:
    """Per-token training loss sum_t p_t CE_t − beta H(p) from CE [R, ...] and log p [R, ...]."""
    p = log_p.exp()
    entropy = -(p * log_p).sum(0)
    return (p * ce).sum(0) - entropy_coeff * entropy


def exit_steps(log_p: torch.Tensor, threshold: float) -> torch.Tensor:
    """The exit step of every token (0-based) [...]: the first t whose cumulative exit probability reaches
    `threshold`; the last step where rounding keeps the sum just under it."""
    reached = log_p.exp().cumsum(0) >= threshold
    reached[-1] = True
    return reached.int().argmax(0)


class ExitStats:
    """Exit statistics summed over evaluation batches: tokens that exit at each step under the threshold rule,
    and the summed exit probability of each step (device tensors, read once at the end)."""

    def __init__(self, recurrences: int, device: torch.device):
        self.exits = torch.zeros(recurrences, dtype=torch.float64, device=device)
        self.probability = torch.zeros(recurrences, dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, log_p: torch.Tensor, steps: torch.Tensor) -> None:
        r = log_p.shape[0]
        if r != self.exits.shape[0]:
            return  # another depth (the depth sweep): not what these statistics describe
        self.exits += F.one_hot(steps.reshape(-1).long(), r).sum(0).double()
        self.probability += log_p.exp().reshape(r, -1).sum(1).double()
        self.tokens += steps.numel()

    def as_tensor(self) -> torch.Tensor:
        return torch.cat([self.exits, self.probability, self.tokens[None]])

    @staticmethod
    def metrics(summed: torch.Tensor, recurrences: int) -> dict[str, float]:
        """`exit_fraction_rN` (share of tokens that exit at step N under the threshold rule),
        `exit_probability_rN` (mean p_N) and `exit_mean_step` (mean exit step, 1-based)."""
        exits, probability, tokens = summed[:recurrences], summed[recurrences:-1], float(summed[-1])
        out = {f"exit_fraction_r{t + 1}": float(exits[t]) / tokens for t in range(recurrences)}
        out.update({f"exit_probability_r{t + 1}": float(probability[t]) / tokens for t in range(recurrences)})
        out["exit_mean_step"] = sum((t + 1) * float(exits[t]) for t in range(recurrences)) / tokens
        return out


@contextmanager
def recording_exit_stats(model, device: torch.device) -> Iterator[ExitStats]:
    """Within the context the model evaluates with the exit rule and sums its exit statistics."""
    stats = ExitStats(model.config.recurrences, device)
    previous = model.exit_rule, model.exit_stats
    model.exit_rule, model.exit_stats = "threshold", stats
    try:
        yield stats
    finally:
        model.exit_rule, model.exit_stats = previous
