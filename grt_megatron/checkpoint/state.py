"""A model's training state as plain named tensors, whatever the layout it runs in.

Every parameter is named as in a one-process `GRTLanguageModel` (a pipeline stage's `3.block.layers.2...`
becomes `block.layers.2...`), and carries three fp32 tensors: the master weight (`param/NAME`) and
AdamW's two moments (`exp_avg/NAME`, `exp_avg_sq/NAME`). Tensors are whole across data parallelism
(ZeRO partitions are gathered through DeepSpeed's tensor-fragment API) and local to the tensor-parallel
rank; `merge_tp` / `split_tp` convert between TP sizes along each parameter's partition dimension.

Why not DeepSpeed's `save_checkpoint`: its files pickle Python objects (its loader calls
`torch.load(weights_only=False)`), and it refuses to load ZeRO partitions into another data-parallel
size. State as named tensors in safetensors files is safe to read and loads into any layout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from grt_megatron.checkpoint.store import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")
# Rows of these tensors are the (padded) vocabulary: their padding depends on the TP size.
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def plain_name(module_name: str, pipelined: bool) -> str:
    """`tied_modules.embed.embedding...` and `4.block.layers...` (pipeline units) -> plain model names."""
    if not pipelined:
        return module_name
    parts = module_name.split(".")
    return ".".join(parts[2:] if parts[0] == "tied_modules" else parts[1:])


def named_parameters(module: torch.nn.Module, pipelined: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """(plain name, parameter), each parameter once, in module order (the same on every DP rank)."""
    out, seen = [], set()
    for name, p in module.named_parameters():
        key = plain_name(name, pipelined)
        if key not in seen and p.requires_grad:
            seen.add(key)
            out.append((key, p))
    return out


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_id") else p.shape


def partition_dim(p: torch.nn.Parameter) -> int:
    """The dimension megatron splits this parameter along over TP ranks; -1 when it is replicated."""
    return int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1


class OptimizerState:
    """Read and write one parameter's fp32 master weight and Adam moments through DeepSpeed's optimizer.

    Three kinds, by what DeepSpeed wrapped around the AdamW we gave it:
    - `copies`: no ZeRO: in fp32 the model's parameters are the master weights; in bf16 DeepSpeed keeps
      an fp32 copy of each (replicated over DP);
    - `fragments`: ZeRO 1/2 and the bf16 optimizer: each DP rank holds a fragment of a flat fp32 copy,
      located by DeepSpeed's per-parameter `_hp_mapping`;
    - `zero3`: parameters themselves are partitioned; the optimizer gathers and scatters them.
    Reading (`own_pieces`) needs no communication: each DP rank gives what it holds.
    """

    def __init__(self, engine):
        self.optimizer = engine.optimizer
        first = next(iter(engine.module.parameters()))
        if hasattr(first, "ds_id"):
            self.kind, self.base = "zero3", self.optimizer.optimizer
            self.flats = list(self.optimizer.fp32_partitioned_groups_flat)
        elif hasattr(first, "_hp_mapping"):
            self.kind, self.base = "fragments", self.optimizer.optimizer
            # ZeRO 1/2 and the bf16 optimizer name their flat fp32 partitions (one per param group) apart.
            self.flats = list(getattr(self.optimizer, "single_partition_of_fp32_groups", None)
                              or self.optimizer.fp32_groups_flat_partition)
        elif hasattr(self.optimizer, "fp16_groups") and hasattr(self.optimizer, "fp32_groups"):
            # bf16 without ZeRO: DeepSpeed keeps one fp32 copy per parameter, replicated over DP.
            self.kind, self.base = "copies", self.optimizer.optimizer
            self.master = {id(lp): hp for lps, hps in zip(self.optimizer.fp16_groups, self.optimizer.fp32_groups)
                           for lp, hp in zip(lps, hps)}
            self.flats = list(self.master.values())
        else:  # fp32 without ZeRO: the parameters are their own master copies
            self.kind, self.base = "copies", self.optimizer
            self.flats = [p for g in self.base.param_groups for p in g["params"]]
            self.master = {id(p): p for p in self.flats}
        if not isinstance(self.base, (torch.optim.AdamW, torch.optim.Adam)):
            raise CheckpointError(f"checkpoints hold torch's Adam/AdamW state; this run's optimizer is "
                                  f"{type(self.base).__name__} (with train.optimizer=deepspeed, set "
                                  "train.torch_adam=true)")

    # ---- optimizer-wide state -------------------------------------------------------------------
    def materialize(self) -> None:
        """Create AdamW's state (step 0, zero moments) where it does not exist yet, as its first step
        would, so that a checkpoint's moments can be written into it before any step has run."""
        # Where torch's AdamW keeps its step count: on the host, but on the parameters' device when fused
        # or capturable (its kernels read it there).
        on_device = any(g.get("fused") or g.get("capturable") for g in self.base.param_groups)
        for flat in self.flats:
            state = self.base.state[flat]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
            for key in MOMENTS:
                if key not in state:  # not `setdefault`: that would allocate and zero a flat buffer each time
                    state[key] = torch.zeros_like(flat)

    def step_count(self) -> int:
        steps = {int(s["step"]) for s in self.base.state.values() if "step" in s}
        return max(steps) if steps else 0

    def set_step_count(self, steps: int) -> None:
        for s in self.base.state.values():
            s["step"] = torch.full_like(s["step"], float(steps))

    # ---- one parameter --------------------------------------------------------------------------
    def _fragment(self, p, key):
        """This DP rank's slice of `p` in the flat fp32 partition (or a moment of it), and where that
        slice sits in the flattened parameter; (None, None) when this rank holds none of `p`."""
        mapping = p._hp_mapping
        if mapping is None:
            return None, None
        flat = self.flats[mapping.param_group_index]
        source = flat.data if key is None else self.base.state[flat][key]
        hp = mapping.hp_fragment_address
        return source.narrow(0, hp.start, hp.numel), mapping.lp_fragment_address

    def _master_copy(self, p: torch.nn.Parameter, key: Optional[str]) -> Optional[torch.Tensor]:
        """`copies` only: the fp32 master weight (key None) or a moment; None for a moment not yet created
        (a parameter that never received a gradient)."""
        master = self.master[id(p)]
        if key is None:
            return master.detach().float()
        state = self.base.state.get(master, {})
        return state[key].detach() if key in state else None

    def own_pieces(self, p: torch.nn.Parameter, key: Optional[str], owner: bool
                   ) -> Optional[list[tuple[int, torch.Tensor]]]:
        """The part of `p`'s fp32 master weight (key None) or moment this DP rank holds, without any
        communication: [(start, tensor)], `start` the first element in the flattened parameter and the
        tensor 1-D, or whole with `p`'s shape when start is 0 and it is all of `p`; [] when this rank
        holds none of it; None for a moment not yet created. Replicated kinds (`copies`) have no partition:
        the `owner` DP rank gives the whole tensor, the others nothing."""
        if self.kind == "copies":
            if not owner:
                return []
            value = self._master_copy(p, key)
            return None if value is None else [(0, value)]
        if key is not None and key not in self.base.state[self.flats[0]]:
            return None
        if self.kind == "fragments":
            piece, where = self._fragment(p, key)
            return [] if piece is None else [(int(where.start), piece)]
        partition, start, count = self._zero3_partition(p, key)
        return [(start, partition.narrow(0, 0, count))] if count else []

    @staticmethod
    def _zero3_partition(p: torch.nn.Parameter, key: Optional[str]) -> tuple[torch.Tensor, int, int]:
        """ZeRO 3: this rank's fp32 partition of `p`'s weight (key None) or moment, padded at the end of
        the last one, with the first element it holds in the flattened `p` and how many are real."""
        opt = p._z3_optimizer
        partition, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        n = partition.numel()
        start = dist.get_rank(group=opt.dp_process_group) * n
        return partition, start, max(0, min(n, p.ds_numel - start))

    def own_range(self, p: torch.nn.Parameter) -> Optional[tuple[int, int]]:
        """(first element, count) of the flattened `p` whose moments this DP rank holds, when that is all a
        load needs to read of them (ZeRO partitions); None when it needs the whole tensor (replicas)."""
        if self.kind == "fragments":
            _, where = self._fragment(p, MOMENTS[0])
            return (0, 0) if where is None else (int(where.start), int(where.numel))
        if self.kind == "zero3":
            _, start, count = self._zero3_partition(p, None)
            return start, count
        return None

    def set_moment_range(self, p: torch.nn.Parameter, key: str, start: int, values: Optional[torch.Tensor]) -> None:
        """Write this rank's partition of a moment from `values`, the flattened elements from `start` on
        (`own_range`); None: zeros (a moment never created)."""
        if self.kind == "fragments":
            piece, where = self._fragment(p, key)
            if piece is not None:
                piece.copy_(values) if values is not None else piece.zero_()
            return
        partition, _, _ = self._zero3_partition(p, key)
        partition.data.zero_()
        if values is not None:
            partition.data[: values.numel()].copy_(values.to(partition.dtype))

    def set(self, p: torch.nn.Parameter, key: Optional[str], value: torch.Tensor) -> None:
        """Write the fp32 master weight (and the model's copy of it) or a moment."""
        if self.kind == "copies":
            master = self.master[id(p)]
            if key is not None:
                self.base.state[master][key].copy_(value)
                return
            master.data.copy_(value)
            p.data.copy_(value.to(p.dtype))
            return
        if self.kind == "fragments":
            piece, where = self._fragment(p, key)
            if piece is not None:
                piece.copy_(value.reshape(-1).narrow(0, where.start, where.numel))
            if key is None:
                p.data.copy_(value.to(p.dtype))  # the bf16/fp32 working copy, as after an optimizer step
            return
        self._set_zero3_partition(p, key, value)
        if key is None:
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters([p], modifier_rank=0):  # rank 0's copy is partitioned on exit
                p.data.copy_(value.to(p.dtype).reshape(p.data.shape))

    def _set_zero3_partition(self, p, key, value) -> None:
        # The partition of a parameter whose size is not a multiple of the DP size is padded at the end.
        partition, start, _ = self._zero3_partition(p, key)
        piece = value.reshape(-1).to(partition.dtype)[start : start + partition.numel()]
        partition.data.zero_()
        partition.data[: piece.numel()].copy_(piece)


# ---- tensor-parallel resharding -------------------------------------------------------------------
def merge_tp(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Whole tensor from its TP shards (in TP rank order); a replicated tensor is taken from rank 0."""
    return shards[0] if dim < 0 or len(shards) == 1 else torch.cat(shards, dim=dim)


def split_tp(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return full if dim < 0 or tp_size == 1 else torch.chunk(full, tp_size, dim=dim)[tp_rank].contiguous()


def fit_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut or zero-pad the padded-vocabulary rows (padding differs across TP sizes; padded rows never
    correspond to a token)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows].contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
