"""Mixture-of-Recursions (`routing="expert_choice"`): one router per recursion replaces the gate.

    A_0 = all positions;  k_r = ceil(S·(R−r+1)/R)                  (capacity shrinks with depth)
    w = sigmoid(router_r(h_t)) for t in A_{r-1};  A_r = the k_r positions of A_{r-1} with the largest w
    h_t += w_t · (Core(h_{A_r})_t − h_t) for t in A_r             (the others have left: unchanged from now on)

The core attends among the active positions only (causally); an auxiliary binary cross-entropy teaches
each router to predict its own top-k choice. The top-k compares a token's score with later tokens' scores,
so outside training the default rule is the causal one the loss prepares for: A_r = {t in A_{r-1}: w_t > 0.5}
where k_r < S (`mor_eval_routing`). docs/design.md says why each choice was made.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from grt_megatron.model.config import GRTConfig, mor_capacity
from grt_megatron.model.init import piece_rng
from grt_megatron.model.layers import StepInputs, later_positions, run_layers


def build_routers(config: GRTConfig, init_seed: int) -> torch.nn.ModuleList:
    """One router (d → 1, no bias) per trained recursion: plain linears, so MoR is refused under TP/SP/PP."""
    with piece_rng(init_seed, "routers"):
        routers = torch.nn.ModuleList(torch.nn.Linear(config.hidden_size, 1, bias=False, dtype=config.params_dtype)
                                      for _ in range(config.recurrences))
        for router in routers:
            config.init_method(router.weight)
    return routers


def active_inputs(inputs: StepInputs, active: torch.Tensor) -> StepInputs:
    """The step inputs of the compact sequence `active` ([n, b] positions). A document mask is cut down to
    the active positions, and stays causal in the compact order too: a padding column's left tokens may
    hold earlier positions than the real tokens before them, and no real token may attend to them."""
    if inputs.attention_mask is None:
        return inputs
    n, b = active.shape
    positions = active.transpose(0, 1)  # [b, n]
    rows = torch.arange(b, device=active.device)[:, None, None]
    mask = inputs.attention_mask[rows, 0, positions[:, :, None], positions[:, None, :]]  # [b, n, n]
    return dataclasses.replace(inputs, attention_mask=(mask | later_positions(n, active.device)).unsqueeze(1))


def run_mor(block, h_pre: torch.Tensor, inputs: StepInputs, recurrences: int) -> torch.Tensor:
    """The block's core run as Mixture-of-Recursions (module docstring). h: [s, b, d], carried in fp32 like
    the gated state; routers and core run in the model's dtype. Sets `block.aux_loss` (training)."""
    dtype = h_pre.dtype
    h = h_pre.float()
    s, b, d = h.shape
    trained = block.config.recurrences
    if recurrences > trained:
        raise ValueError(f"MoR has routers for {trained} recursions; cannot run {recurrences}")
    causal = not block.training and block.mor_eval_routing == "threshold"
    # The tokens still recurring, as positions in ascending order, one column per sequence. Under the
    # causal threshold sequences keep different numbers of tokens: a column is padded at its end with
    # positions that have left (`valid` False), which no real token attends to under causal attention.
    active = torch.arange(s, device=h.device).unsqueeze(1).expand(s, b)
    valid = torch.ones(s, b, dtype=torch.bool, device=h.device)
    aux = []
    for r in range(recurrences):
        candidates = h.gather(0, active.unsqueeze(-1).expand(-1, -1, d))
        logits = block.routers[r](candidates.to(dtype)).squeeze(-1).float()  # [n, b]
        n, k = active.shape[0], mor_capacity(s, trained, r)
        if causal:
            # sigmoid > 0.5: the token's own score alone decides. Where training keeps every token
            # (capacity S, the first recursion), so does evaluation.
            keep = valid if k >= s else valid & (logits > 0)
        elif k >= n:
            keep = valid
        else:
            keep = torch.zeros_like(valid).scatter_(0, logits.topk(k, dim=0).indices, True)
        if block.training:
            aux.append(F.binary_cross_entropy_with_logits(logits, keep.float()))
        # Kept tokens first, in position order; a column with fewer of them is padded by left ones.
        index = torch.arange(n, device=h.device).unsqueeze(1)
        if causal:  # sequences keep different numbers of tokens: the host must learn the largest
            width = int(keep.sum(0).max())
        else:  # top-k keeps exactly k of every sequence (all n where k >= n): known without waiting
            width = min(k, n)
        chosen = torch.where(keep, index, index + n).argsort(dim=0)[:width]
        active, valid = active.gather(0, chosen), keep.gather(0, chosen)
        if width == 0:  # every token has left
            break
        x = candidates.gather(0, chosen.unsqueeze(-1).expand(-1, -1, d))
        # The compact sequence keeps the positions' order, so the layers' causal attention is causal
        # among the active tokens: a token attends to the earlier tokens that are still recurring.
        o = run_layers(block.core, x.to(dtype), active_inputs(inputs, active)).float()
        w = torch.sigmoid(logits.gather(0, chosen)).unsqueeze(-1)
        update = torch.where(valid.unsqueeze(-1), x + w * (o - x), x)
        h_new = h.scatter(0, active.unsqueeze(-1).expand(-1, -1, d), update)
        if block.step_hooks:  # diagnostics only: the masked gate is a sync (its size), so only when asked
            block.call_step_hooks(h, h_new, w[valid], step=r, active=valid.sum(), positions=s * b)
        h = h_new
    block.aux_loss = torch.stack(aux).sum() if aux else None
    return h.to(dtype)
