"""Pipeline parallelism through DeepSpeed's `PipelineModule`, its units cut from the one model definition.

Why DeepSpeed's engine and not megatron-core's schedules: megatron's schedules send one [s, b, hidden]
tensor per stage boundary and allocate on "cuda"; DeepSpeed's pass tuples of tensors (we need the
per-sample noise seeds and the step's depth next to the hidden state) and run on gloo, with ZeRO 1 and
tied embeddings handled. Every unit is a `GRTLanguageModel` built with one part (`PipelineUnit`), running
that model's own methods: the model math exists once, and a pipelined model starts from the exact weights
of a single-process one (each piece is initialised from its own seed, model/init.py).

Units, in order: embedding (tied with the head), one unit per prelude layer, the recurrent core (all R
recurrences, injection and gate — one unit, so the recurrence never crosses a stage boundary; a dense
model has no recurrence and its layers are units of their own), one unit per coda layer, the final norm,
the head. Stages take contiguous units, balanced by forward FLOPs (the core counts K·R layers with its
gate and projection, the head 2·d·V).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.language_model import GRTLanguageModel, attention_mask_of, vocab_parallel_loss
from grt_megatron.model.layers import StepInputs, run_layers
from grt_megatron.parallel.pipeline_stages import plan_pipeline_stages

TIED_WEIGHT = "embedding.word_embeddings.weight"


class HostCopy:
    """A small tensor's values on the host, read once per tensor. The seeds and the depth travel between
    stages as device tensors (DeepSpeed sends tensors only) and every unit of a stage needs them as Python
    numbers; reading them is a device sync, so each stage reads a micro-batch's once (its first unit) and its
    later units reuse that, instead of a sync per unit that idles the GPU between them."""

    def __init__(self) -> None:
        self._source: Optional[weakref.ref] = None
        self._values: list = []

    def __call__(self, tensor: torch.Tensor) -> list:
        if self._source is None or self._source() is not tensor:
            self._values, self._source = tensor.tolist(), weakref.ref(tensor)
        return self._values


# One per process (a stage's units run in one): the units hand the same seed and depth tensors on.
HOST_SEEDS, HOST_DEPTH = HostCopy(), HostCopy()


class PipelineUnit(GRTLanguageModel):
    """One pipeline unit: the model built with only `unit`'s part. Between units travel
    (hidden, noise seeds, depth[, document ids]); the first takes (tokens, seeds, depth[, document ids]),
    the last two return tensors. Document ids (`data.reset_attention_mask`) ride along so that every
    stage builds the same document mask.

    `unit`: `embedding` (with the weightless tied head when embeddings are tied), `layer` (block layer
    `layer`), `core` (all core layers, the injection and the gate: the whole recurrence), `final_norm`,
    `output_layer`. Parameter names stay the model's (`block.layers.3...` under the unit's index)."""

    def __init__(self, config: GRTConfig, init_seed: int, unit: str, layer: Optional[int] = None):
        parts, layers = {
            "embedding": (("embedding", "output_layer") if config.tie_embeddings else ("embedding",), None),
            "layer": (("block",), [layer]),
            "core": (("block",), range(config.prelude_layers, config.prelude_layers + config.core_layers)),
            "final_norm": (("final_norm",), None),
            "output_layer": (("output_layer",), None),
        }[unit]
        super().__init__(config, init_seed, parts=parts, layers=layers)
        self.unit, self.layer = unit, layer

    def _step_inputs(self, hidden: torch.Tensor, seeds: torch.Tensor, documents) -> StepInputs:
        """Mask, RoPE and noise seeds; the full sequence length is recovered under SP."""
        s = hidden.shape[0]
        if self.config.sequence_parallel:
            s *= parallel_state.get_tensor_model_parallel_world_size()
        rope = self.rotary_pos_emb(s) if self.rotary_pos_emb is not None else None
        mask = attention_mask_of(self.config, documents[0] if documents else None)
        return StepInputs(mask, rope, HOST_SEEDS(seeds))

    def forward(self, inputs):
        if self.unit == "embedding":
            tokens, *rest = inputs
            return (self.embed(tokens), *rest)
        if self.unit == "final_norm":
            return self.final_norm(inputs[0])
        if self.unit == "output_layer":
            return self.logits(inputs)
        hidden, seeds, depth, *documents = inputs
        step = self._step_inputs(hidden, seeds, documents)
        if self.unit == "core":
            r, grad_r = (int(v) for v in HOST_DEPTH(depth))
            hidden = self.block.run_core(hidden, step, r, grad_r)
        else:
            hidden = run_layers([self.block.layers[self.layer]], hidden, step)
        return (hidden, seeds, depth, *documents)


def tied_head(unit: PipelineUnit, hidden: torch.Tensor) -> torch.Tensor:
    """The last unit when embeddings are tied: the embedding unit's weight as the LM head."""
    return unit.logits(hidden)


def pipeline_unit_specs(config: GRTConfig, init_seed: int, names: Sequence[str]) -> list:
    """The LayerSpec of each unit, by name (`pipeline_unit_names`, the one list of them)."""

    def spec(name: str):
        if name in ("embedding", "head") and config.tie_embeddings:
            extra = {"forward_fn": tied_head} if name == "head" else {}
            return TiedLayerSpec("embed", PipelineUnit, config, init_seed, "embedding", tied_weight_attr=TIED_WEIGHT,
                                 **extra)
        if name.startswith("layer."):  # a dense model's core layers too: no recurrence keeps them together
            return LayerSpec(PipelineUnit, config, init_seed, "layer", int(name.removeprefix("layer.")))
        return LayerSpec(PipelineUnit, config, init_seed, "output_layer" if name == "head" else name)

    return [spec(name) for name in names]


class GRTPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule with our partition (`plan_pipeline_stages`) instead of its methods."""

    def __init__(self, config: GRTConfig, init_seed: int, pp: int, dp_size: int, seq_len: int,
                 split_points: Optional[Sequence[str]] = None):
        self.stages = plan_pipeline_stages(config, seq_len, pp, split_points)
        tp = config.tensor_model_parallel_size
        super().__init__(
            layers=pipeline_unit_specs(config, init_seed, self.stages.names),
            loss_fn=lambda logits, labels: vocab_parallel_loss(logits, labels, self.fused_loss).mean(),
            topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp_size),
            partition_method="uniform",  # replaced by _partition_layers below
            activation_checkpoint_interval=0,
        )
        self.config = config
        self.fused_loss = False  # as GRTLanguageModel's: set by train.compile

    @property
    def split_points(self) -> list[str]:
        """The units stages 2..pp begin at, as `parallel.pp_split_points` names them (saved with a checkpoint:
        a resume that cuts the stages elsewhere gives layers other ranks' RNG streams, so it reseeds)."""
        return self.stages.split_points

    def describe_stages(self) -> str:
        return self.stages.describe()

    def _partition_layers(self, method="uniform"):
        self.parts = [*self.stages.starts, len(self._layer_specs)]
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
