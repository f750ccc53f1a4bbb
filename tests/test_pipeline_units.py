"""Pipeline pieces without launching: stage partitioning and per-piece initialisation."""

import pytest
import torch

from conftest import tiny_config
from grt_megatron.model import ConfigError, GRTLanguageModel
from grt_megatron.parallel.pipeline import PipelineUnit, balanced_stage_starts, pipeline_units


def test_balanced_stage_starts():
    # embed, P0, core (K·R = 4), C0, norm, head
    costs = [0, 1, 4, 1, 0, 0]
    assert balanced_stage_starts(costs, 1) == [0]
    starts = balanced_stage_starts(costs, 2)
    assert starts in ([0, 2], [0, 3])  # the core never shares a stage with both prelude and coda
    assert balanced_stage_starts(costs, 3) == [0, 2, 3]  # prelude | core | coda
    assert balanced_stage_starts([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="only 4 pipeline units"):
        balanced_stage_starts([1, 1, 1, 1], 5)


def test_units_keep_the_core_whole_and_split_dense(world):
    grt = tiny_config(prelude_layers=2, core_layers=3, coda_layers=1, recurrences=4)
    units, costs = pipeline_units(grt, init_seed=0)
    assert costs == [0, 1, 1, 12, 1, 0, 0] and len(units) == len(costs)
    dense = tiny_config(prelude_layers=0, core_layers=4, coda_layers=0, recurrences=1, gate="none",
                        injection="none", noise_sigma=0.0)
    assert pipeline_units(dense, init_seed=0)[1] == [0, 1, 1, 1, 1, 0, 0]


def test_pieces_built_alone_have_the_full_models_weights(world):
    """What lets a pipeline stage start from exactly the single-process weights: every unit is the one
    model built with one part, under the model's own parameter names."""
    cfg = tiny_config(prelude_layers=1, core_layers=2, coda_layers=1, tie_embeddings=False)
    full = GRTLanguageModel(cfg, init_seed=7).state_dict()
    core = PipelineUnit(cfg, 7, "core")
    assert isinstance(core.block.layers[0], torch.nn.Identity) and isinstance(core.block.layers[3], torch.nn.Identity)
    assert core.embedding is None and core.final_norm is None and core.output_layer is None
    tensors = {k: v for k, v in core.state_dict().items() if isinstance(v, torch.Tensor)}  # not _extra_state
    assert any(k.startswith("block.gate_fc1") for k in tensors) and any(k.startswith("block.layers.2.") for k in tensors)
    for name, value in tensors.items():
        assert torch.equal(value, full[name]), name
    one = PipelineUnit(cfg, 7, "layer", 3)
    assert set(one.state_dict()) == {k for k in full if k.startswith("block.layers.3.")}
    for unit, prefix in (("embedding", "embedding."), ("final_norm", "final_norm."), ("output_layer", "output_layer.")):
        part = PipelineUnit(cfg, 7, unit).state_dict()
        assert set(part) == {k for k in full if k.startswith(prefix)}, unit
        assert all(torch.equal(part[k], full[k]) for k in part if isinstance(part[k], torch.Tensor)), unit
    assert not torch.equal(GRTLanguageModel(cfg, init_seed=8).state_dict()["block.layers.0.mlp.linear_fc1.weight"],
                           full["block.layers.0.mlp.linear_fc1.weight"])


def test_layout_check_counts_pipeline_units():
    from grt_megatron.parallel import validate_layout

    model = dict(prelude_layers=1, core_layers=2, coda_layers=1, recurrences=4, gate="mlp", injection="add",
                 num_attention_heads=4, hidden_size=64)
    common = dict(tp=1, sp=False, zero_stage=1, seq_length=32, micro_batch=1, global_batch=8)
    assert validate_layout(world_size=8, pp=4, model=model, **common) == 2  # 6 units: fine
    with pytest.raises(ConfigError, match="parallel.pp=8 stages but the model has only 6 pipeline units"):
        validate_layout(world_size=8, pp=8, model=model, **common)
    dense = dict(model, prelude_layers=0, coda_layers=0, core_layers=6, recurrences=1, gate="none", injection="none")
    assert validate_layout(world_size=8, pp=8, model=dense, **common) == 1  # dense layers are units each


def test_a_stage_reads_each_micro_batchs_seeds_and_depth_once(world):
    """Seeds and depth arrive on a stage as device tensors; reading them is a device sync. A stage's units
    share one read per micro-batch (parallel/pipeline.py HostCopy) instead of a sync per unit, with the
    same result as reading them in every unit."""
    from grt_megatron.training.host_waits import HostWaitCounter

    cfg = tiny_config(prelude_layers=2, core_layers=1, coda_layers=2, recurrences=3)
    stage = [PipelineUnit(cfg, 7, "layer", 0), PipelineUnit(cfg, 7, "layer", 1), PipelineUnit(cfg, 7, "core"),
             PipelineUnit(cfg, 7, "layer", 3), PipelineUnit(cfg, 7, "layer", 4)]

    def run(batch: int):  # one micro-batch through the stage, as DeepSpeed's engine hands it on
        g = torch.Generator().manual_seed(batch)
        outputs = (torch.randn(16, 2, cfg.hidden_size, generator=g), torch.tensor([batch, batch + 1]),
                   torch.tensor([3, 2]))
        for unit in stage:
            outputs = unit.train()(outputs)
        return outputs[0]

    with HostWaitCounter() as counter:
        first, second = run(0), run(1)
    assert counter.reads == 4  # (seeds, depth) once per micro-batch, not once per unit (10)
    again = run(0)  # new tensors with micro-batch 0's values: read afresh, same result
    assert torch.equal(again, first) and not torch.equal(first, second)
