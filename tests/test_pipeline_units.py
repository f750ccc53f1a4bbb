"""Pipeline pieces without launching: stage partitioning and per-piece initialisation."""

import pytest
import torch

from conftest import tiny_config
from grt_megatron.model import ConfigError, GRTLanguageModel
from grt_megatron.parallel.pipeline import PipelineUnit, pipeline_unit_specs
from grt_megatron.parallel.pipeline_stages import balanced_stage_starts, plan_pipeline_stages


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
    # A head that costs 2 layers: among the splits at the core's pace (4), the embedding joins the prelude
    # layer instead of standing alone, and the final norm goes with the head.
    assert balanced_stage_starts([0, 1, 4, 1, 0, 2], 4) == [0, 2, 3, 4]
    # 8 layers and a head of 2: layers alone would give [2, 2, 2, 2 + head]; the head's stage takes fewer.
    assert balanced_stage_starts([0, *[1] * 8, 0, 2], 4) == [0, 3, 5, 8]  # 2 | 2 | 3 | 1 + 0 + 2
    # Integers throughout: FLOPs of real shapes (10^9 per token and more) split exactly.
    big = [0, *[12 * 10**9] * 24, 0, 42 * 10**9]
    stages = balanced_stage_starts(big, 4) + [len(big)]
    assert max(sum(big[a:b]) for a, b in zip(stages, stages[1:])) == 7 * 12 * 10**9


def test_units_keep_the_core_whole_and_split_dense(world):
    from grt_megatron.model.flops import _layer_flops, _prelude_terms_flops, _recurrence_extra_flops

    grt = tiny_config(prelude_layers=2, core_layers=3, coda_layers=1, recurrences=4)
    stages = plan_pipeline_stages(grt, seq_len=32, pp=1)
    names, costs, units = stages.names, stages.costs, pipeline_unit_specs(grt, 0, stages.names)
    layer, head = _layer_flops(grt, 32), 2 * grt.hidden_size * grt.padded_vocab_size
    assert _recurrence_extra_flops(grt) > 0
    core = 4 * (3 * layer + _recurrence_extra_flops(grt)) + _prelude_terms_flops(grt)
    assert costs == [0, layer, layer, core, layer, 0, head]
    assert len(units) == len(costs) == len(names)
    dense = tiny_config(prelude_layers=0, core_layers=4, coda_layers=0, recurrences=1, gate="none",
                        injection="none", noise_sigma=0.0)
    assert plan_pipeline_stages(dense, seq_len=32, pp=1).costs == [0, layer, layer, layer, layer, 0, head]


def test_medium_shapes_balance_the_head():
    """The partitions the medium recipes get (d 1024, GPT-2 vocabulary, seq 1024): the dense model's head
    (3.5 layers) no longer lands on a last stage of 6 layers, and the GRT's stages beside its core do not
    leave the embedding alone."""
    from grt_megatron.model.config import GRTConfig
    from grt_megatron.model.flops import pipeline_unit_flops
    from grt_megatron.parallel.layout import pipeline_unit_names

    shape = dict(hidden_size=1024, num_attention_heads=16, vocab_size=50257, max_sequence_length=1024)
    dense = GRTConfig(**shape, prelude_layers=0, core_layers=24, recurrences=1, coda_layers=0, gate="none",
                      injection="none", noise_sigma=0.0)
    costs = pipeline_unit_flops(dense, 1024, pipeline_unit_names(0, 24, 0, dense=True))
    assert balanced_stage_starts(costs, 4) == [0, 8, 15, 22]  # 7 | 7 | 7 | 3 + head (3.5 layers)
    grt = GRTConfig(**shape, prelude_layers=2, core_layers=5, recurrences=4, coda_layers=2, gate="mlp",
                    injection="concat_project")
    costs = pipeline_unit_flops(grt, 1024, pipeline_unit_names(2, 5, 2, dense=False))
    assert balanced_stage_starts(costs, 5) == [0, 2, 3, 4, 6]  # embed + P0 | P1 | core | C0 C1 | norm + head


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


def test_split_points_name_units_and_are_refused_with_the_units_listed():
    from grt_megatron.parallel import validate_layout
    from grt_megatron.parallel.layout import pipeline_unit_names

    assert pipeline_unit_names(2, 3, 1, dense=False) == [
        "embedding", "layer.0", "layer.1", "core", "layer.5", "final_norm", "head"]
    assert pipeline_unit_names(0, 3, 0, dense=True) == ["embedding", "layer.0", "layer.1", "layer.2", "final_norm",
                                                        "head"]
    model = dict(prelude_layers=1, core_layers=2, coda_layers=1, recurrences=4, gate="mlp", injection="add",
                 num_attention_heads=4, hidden_size=64)
    common = dict(world_size=4, tp=1, sp=False, zero_stage=1, seq_length=32, micro_batch=1, global_batch=8)
    assert validate_layout(pp=4, model=model, split_points=["layer.0", "core", "layer.3"], **common) == 1
    for points, pp, needle in (
        (["core"], 4, r"names 1 units; parallel.pp=4 needs 3 \(where stages 2..4 begin\)"),
        (["layer.1"], 2, "layer.1 is not a pipeline unit of this model; its units: embedding, layer.0, core, "
                         "layer.3, final_norm, head"),
        (["core", "layer.0"], 3, "must be in model order"),
        (["core", "core"], 3, "must be in model order"),
        (["embedding"], 2, "must be in model order, after the first"),
        (["core"], 1, r"parallel.pp_split_points=\['core'\] needs parallel.pp > 1"),
    ):
        with pytest.raises(ConfigError, match=needle):
            validate_layout(pp=pp, model=model, split_points=points, **{**common, "world_size": pp})
    assert validate_layout(pp=1, model=model, split_points=[], **{**common, "world_size": 1}) == 1


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
