"""Per-piece initialisation: each piece of the model (the embedding, layer i, the injection, the gate, the
final norm, the output layer) draws its initial weights from its own seed, a function of (run seed,
piece name) alone. A pipeline stage that builds only its own pieces then holds exactly the weights a
single process would, and tensor-parallel layouts agree too (megatron initialises whole then splits)."""

from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch


@contextmanager
def piece_rng(init_seed: int, piece: str):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((init_seed * 1_000_003 + zlib.crc32(piece.encode())) % (2**63))
        yield
