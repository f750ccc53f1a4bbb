"""Pipeline parallelism through DeepSpeed's `PipelineModule`, built from the same model pieces.

Why DeepSpeed's engine and not megatron-core's schedules: megatron's schedules send one [s, b, hidden]
tensor per stage boundary and allocate on "cuda"; DeepSpeed's pass tuples of tensors (we need the
per-sample noise seeds and the step's depth next to the hidden state) and run on gloo, with ZeRO 1 and
tied embeddings handled. The model math is not copied: every unit wraps the modules `GRTLanguageModel`
uses (megatron `TransformerLayer`s, the `GatedRecurrentBlock`'s `run_core`), initialised per piece with
the same seeds, so a pipelined model starts from the exact weights of a single-process one.

Units, in order: embedding (tied with the head), one unit per prelude layer, the recurrent core (all R
recurrences, injection and gate — one unit, so the recurrence never crosses a stage boundary; a dense
model has no recurrence and its layers are units of their own), one unit per coda layer, the final norm,
the head. Stages take contiguous units, balanced by layer executions (the core counts K·R).
"""

from __future__ import annotations

from typing import Sequence

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import build_module

from grt_megatron.model.config import ConfigError, GRTConfig
from grt_megatron.model.language_model import (
    build_embedding,
    build_final_norm,
    build_output_layer,
    build_rotary,
    causal_attention_mask,
    vocab_parallel_loss,
)
from grt_megatron.model.recurrent_block import StepInputs
from grt_megatron.model.specs import get_grt_block_spec


def _step_inputs(config: GRTConfig, hidden: torch.Tensor, rotary, seeds: torch.Tensor) -> StepInputs:
    """Mask, RoPE and noise seeds for a unit; the full sequence length is recovered under SP."""
    s = hidden.shape[0]
    if config.sequence_parallel:
        s *= parallel_state.get_tensor_model_parallel_world_size()
    rope = rotary(s) if rotary is not None else None
    return StepInputs(causal_attention_mask(s, hidden.device), rope, seeds.tolist())


class EmbeddingPipe(torch.nn.Module):
    """(tokens, seeds, depth) -> (hidden, seeds, depth). Also the tied head (`lm_head`)."""

    def __init__(self, config: GRTConfig, init_seed: int):
        super().__init__()
        self.embedding = build_embedding(config, init_seed)
        self.output_layer = build_output_layer(config, init_seed, tied=True)

    def forward(self, inputs):
        tokens, seeds, depth = inputs
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        return self.embedding(input_ids=tokens, position_ids=positions), seeds, depth


def lm_head(module: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    logits, _ = module.output_layer(hidden, weight=module.embedding.word_embeddings.weight)
    return logits


class OutputLayerPipe(torch.nn.Module):
    """The head with its own weight (`tie_embeddings: false`)."""

    def __init__(self, config: GRTConfig, init_seed: int):
        super().__init__()
        self.output_layer = build_output_layer(config, init_seed, tied=False)

    def forward(self, hidden):
        return self.output_layer(hidden)[0]


class BlockPipe(torch.nn.Module):
    """Some layers of the block (`pieces` and, for a dense core, one layer index), or the whole core."""

    def __init__(self, config: GRTConfig, init_seed: int, piece: str, layer: int | None = None):
        super().__init__()
        self.config = config
        self.block = build_module(get_grt_block_spec(config), config=config, pieces=(piece,), init_seed=init_seed,
                                  only_layers=None if layer is None else [layer])
        self.piece, self.layer = piece, layer
        self.rotary = build_rotary(config)

    def forward(self, inputs):
        hidden, seeds, depth = inputs
        step = _step_inputs(self.config, hidden, self.rotary, seeds)
        if self.piece == "core" and self.layer is None:
            r, grad_r = (int(v) for v in depth.tolist())
            hidden = self.block.run_core(hidden, step, r, grad_r)
        else:
            hidden = self.block._run([self.block.layers[self.layer]], hidden, step)
        return hidden, seeds, depth


class FinalNormPipe(torch.nn.Module):
    def __init__(self, config: GRTConfig, init_seed: int):
        super().__init__()
        self.final_norm = build_final_norm(config, init_seed)

    def forward(self, inputs):
        return self.final_norm(inputs[0])


def pipeline_units(config: GRTConfig, init_seed: int) -> tuple[list, list[int]]:
    """The LayerSpecs in order and the layer executions each costs (for partitioning)."""
    units: list = [TiedLayerSpec("embed", EmbeddingPipe, config, init_seed,
                                 tied_weight_attr="embedding.word_embeddings.weight")
                   if config.tie_embeddings else LayerSpec(EmbeddingPipe, config, init_seed)]
    costs = [0]
    p, k = config.prelude_layers, config.core_layers
    for i in range(p):
        units.append(LayerSpec(BlockPipe, config, init_seed, "prelude", i))
        costs.append(1)
    if config.is_dense:  # no recurrence: the core layers can sit on different stages
        for i in range(p, p + k):
            units.append(LayerSpec(BlockPipe, config, init_seed, "core", i))
            costs.append(1)
    else:
        units.append(LayerSpec(BlockPipe, config, init_seed, "core"))
        costs.append(k * config.recurrences)
    for i in range(p + k, config.num_layers):
        units.append(LayerSpec(BlockPipe, config, init_seed, "coda", i))
        costs.append(1)
    units.append(LayerSpec(FinalNormPipe, config, init_seed))
    costs.append(0)
    if config.tie_embeddings:
        units.append(TiedLayerSpec("embed", EmbeddingPipe, config, init_seed, forward_fn=lm_head,
                                   tied_weight_attr="embedding.word_embeddings.weight"))
    else:
        units.append(LayerSpec(OutputLayerPipe, config, init_seed))
    costs.append(0)
    return units, costs


def balanced_stage_starts(costs: Sequence[int], stages: int) -> list[int]:
    """Contiguous, non-empty stages minimising the costliest stage (ties: earlier boundaries)."""
    n = len(costs)
    if stages > n:
        raise ConfigError(f"parallel.pp={stages} stages but the model has only {n} pipeline units "
                          "(embedding, prelude layers, the core, coda layers, final norm, head)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: minimal max-cost splitting units[:i] into j stages; cut[j][i]: start of the last stage.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for j in range(1, stages + 1):
        for i in range(j, n + 1):
            for start in range(j - 1, i):
                value = max(best[j - 1][start], prefix[i] - prefix[start])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, start
    starts, i = [], n
    for j in range(stages, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


class GRTPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule with our partition (`balanced_stage_starts`) instead of its methods."""

    def __init__(self, config: GRTConfig, init_seed: int, pp: int, dp_size: int):
        units, costs = pipeline_units(config, init_seed)
        tp = config.tensor_model_parallel_size
        self.stage_starts = balanced_stage_starts(costs, pp)
        self.unit_costs = costs
        super().__init__(
            layers=units,
            loss_fn=lambda logits, labels: vocab_parallel_loss(logits, labels).mean(),
            topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp_size),
            partition_method="uniform",  # replaced by _partition_layers below
            activation_checkpoint_interval=0,
        )
        self.config = config

    def _partition_layers(self, method="uniform"):
        self.parts = [*self.stage_starts, len(self._layer_specs)]
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
