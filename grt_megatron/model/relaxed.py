"""Relaxed Recursive Transformer (RRT, Bae et al.): the shared core plus a low-rank delta per recursion.

    recursion r runs every linear of every core layer as  y = W·x + B_r·(A_r·x)     (r = 0 … R−1)

A_r: [rank, in], B_r: [out, rank], one pair per (core layer, linear, recursion); from scratch B_r = 0, so an
RRT starts as the plain shared core, bit for bit (the delta it adds is exactly zero). `relax_dense_state` builds the paper's initialisation from a dense model instead. Recursions past
the trained R (the depth sweep, a heavy-tail draw) reuse the last delta.

The deltas are attached to the core's linears by forward hooks, so the linears keep their names: a
checkpoint, the dense initialisation and the parameter counts see the core exactly as without LoRA; the
deltas live beside it as `block.lora.layers.<core layer>.<linear>.a` / `.b`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from grt_megatron.model.init import piece_rng

RELAXED_LINEARS = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
                   "linear_fc1": "mlp", "linear_fc2": "mlp"}
"""The linears of a transformer layer that get a delta, and the submodule holding each."""


class RecursionLoRA(torch.nn.Module):
    """The deltas of one linear: `a` [R, rank, in], `b` [R, out, rank]."""

    def __init__(self, recursions: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(recursions, rank, in_features, dtype=dtype, device="cpu"))
        self.b = torch.nn.Parameter(torch.zeros(recursions, out_features, rank, dtype=dtype, device="cpu"))
        # A as nn.Linear initialises its weight (uniform, bound 1/sqrt(in)), B zero: LoRA's choice, so the
        # model starts as the shared core and B gets a gradient of useful size from the first step.
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.a.uniform_(-bound, bound)

    def delta(self, x: torch.Tensor, recursion: int) -> torch.Tensor:
        return F.linear(F.linear(x, self.a[recursion]), self.b[recursion])


class RecursionAdapters(torch.nn.Module):
    """One `RecursionLoRA` per relaxed linear of each core layer, and the recursion the core runs now."""

    def __init__(self, config, core_layers, init_seed: int):
        super().__init__()
        self.recursions = config.recurrences
        self.active: Optional[int] = None
        with piece_rng(init_seed, "lora"):
            self.layers = torch.nn.ModuleList()
            for layer in core_layers:
                linears = torch.nn.ModuleDict()
                for name, parent in RELAXED_LINEARS.items():
                    base = getattr(getattr(layer, parent), name)
                    out_features, in_features = base.weight.shape
                    linears[name] = RecursionLoRA(config.recurrences, config.lora_rank, in_features, out_features,
                                                  config.params_dtype)
                self.layers.append(linears)
        self._handles = [getattr(getattr(layer, parent), name).register_forward_hook(self._hook(i, name))
                         for i, layer in enumerate(core_layers) for name, parent in RELAXED_LINEARS.items()]

    def _hook(self, index: int, name: str):
        def add_delta(module, args, output):
            if self.active is None:
                raise RuntimeError("an RRT core linear ran outside a recursion step (RecursionAdapters.at)")
            out, bias = output
            return out + self.layers[index][name].delta(args[0], self.active).to(out.dtype), bias

        return add_delta

    @contextmanager
    def at(self, step: int) -> Iterator[None]:
        """The core runs recursion `step` (0-based) inside this context; past the trained R, the last one's delta."""
        previous, self.active = self.active, min(step, self.recursions - 1)
        try:
            yield
        finally:
            self.active = previous


def lora_parameters_per_layer(hidden: int, ffn: int, rank: int) -> int:
    """Delta parameters of one core layer for one recursion: rank · (in + out) over QKV, proj, fc1, fc2."""
    return rank * ((hidden + 3 * hidden) + (hidden + hidden) + (hidden + ffn) + (ffn + hidden))


def relax_dense_state(dense: dict[str, torch.Tensor], *, prelude: int, core: int, recurrences: int, coda: int,
                      rank: int) -> dict[str, torch.Tensor]:
    """RRT weights (a plain one-process state dict) from a dense model's with P + K·R + C layers: the prelude
    and coda are the dense model's first P and last C layers; core layer k shares the mean of the dense layers
    it ties (P + r·K + k for r < R), and recursion r's delta B_r A_r is the rank-`rank` truncated SVD of
    (that dense layer − the mean), on every relaxed linear; norms and biases take the mean. At full rank the
    relaxed core reproduces each dense layer (up to the SVD's rounding)."""
    depth = prelude + core * recurrences + coda
    layer_ids = {int(k.split(".")[2]) for k in dense if k.startswith("block.layers.")}
    if layer_ids != set(range(depth)):
        raise ValueError(f"the dense model has {len(layer_ids)} layers; relaxing into "
                         f"{prelude}+{core}x{recurrences}+{coda} needs {depth}")
    out = {k: v for k, v in dense.items() if not k.startswith("block.layers.")}

    def dense_layer(i: int) -> dict[str, torch.Tensor]:
        start = f"block.layers.{i}."
        return {k[len(start):]: v for k, v in dense.items() if k.startswith(start)}

    for i in range(prelude):
        out.update({f"block.layers.{i}.{k}": v for k, v in dense_layer(i).items()})
    for j in range(coda):
        out.update({f"block.layers.{prelude + core + j}.{k}": v
                    for k, v in dense_layer(prelude + core * recurrences + j).items()})
    for k in range(core):
        tied = [dense_layer(prelude + r * core + k) for r in range(recurrences)]
        for name in tied[0]:
            shared = torch.stack([t[name].double() for t in tied]).mean(0)
            out[f"block.layers.{prelude + k}.{name}"] = shared.to(tied[0][name].dtype)
            linear = name.rsplit(".", 2)
            if len(linear) == 3 and linear[1] in RELAXED_LINEARS and linear[2] == "weight":
                a, b = [], []
                for t in tied:
                    u, s, vh = torch.linalg.svd(t[name].double() - shared, full_matrices=False)
                    root = s[:rank].sqrt()
                    b.append(u[:, :rank] * root)  # [out, rank]
                    a.append(root[:, None] * vh[:rank])  # [rank, in]
                    if rank > len(s):  # a rank above min(out, in): the extra directions are zero
                        b[-1] = F.pad(b[-1], (0, rank - len(s)))
                        a[-1] = F.pad(a[-1], (0, 0, 0, rank - len(s)))
                prefix = f"block.lora.layers.{k}.{linear[1]}"
                out[f"{prefix}.a"] = torch.stack(a).to(tied[0][name].dtype)
                out[f"{prefix}.b"] = torch.stack(b).to(tied[0][name].dtype)
    return out
