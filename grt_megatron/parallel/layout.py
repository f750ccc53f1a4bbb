"""Whether a parallel layout can run, decided before any process group starts or any data is prepared.

`validate_layout` is the one check of a layout: grt-train (through `build_run_config`), grt-submit's dry
run (the same function at the job's world size) and the model and pipeline builders call it or the rules
below, so a layout is refused with one reason, the same everywhere. Pure functions: no torch, no groups.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from grt_megatron.errors import ConfigError


def split_global_batch(global_batch: int, micro_batch: Optional[int], dp: int, layout: str = "") -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) that make up `global_batch` on `dp` data-parallel
    ranks; `micro_batch` None: each rank's whole share at once. A split that does not work is refused,
    naming the micro-batch sizes that would (`layout` says where `dp` came from)."""
    where = f"data-parallel size {dp}{layout}"
    if global_batch % dp:
        raise ConfigError(f"train.global_batch_size={global_batch} cannot be shared by {where}: it must be a "
                          f"multiple of {dp}")
    per_rank = global_batch // dp
    micro = per_rank if micro_batch is None else micro_batch
    if per_rank % micro:
        fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ConfigError(f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size "
                          f"({micro}) × {where}; micro-batch sizes that work: {', '.join(map(str, fits))}")
    return micro, per_rank // micro


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """The data-parallel size of `world_size` processes in tp × pp model-parallel groups."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel.tp={tp} and parallel.pp={pp} must be >= 1")
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} processes cannot be split into parallel.tp={tp} × parallel.pp={pp} "
                          "groups (the world size must be a multiple of tp × pp)")
    return world_size // (tp * pp)


def pipeline_unit_names(prelude: int, core: int, coda: int, dense: bool) -> list[str]:
    """The pipeline units of a model, in order, by the names `parallel.pp_split_points` takes: embedding,
    layer.<i> for each prelude layer, core (the recurrent core: all K layers and R recurrences, one unit),
    or layer.<i> for each of a dense model's K layers (no recurrence to keep whole), layer.<i> for each
    coda layer, final_norm, head. `parallel/pipeline.py` builds exactly these units."""
    middle = [f"layer.{prelude + i}" for i in range(core)] if dense else ["core"]
    return ["embedding", *(f"layer.{i}" for i in range(prelude)), *middle,
            *(f"layer.{prelude + core + i}" for i in range(coda)), "final_norm", "head"]


def stage_starts_from_split_points(names: Sequence[str], split_points: Sequence[str], pp: int) -> list[int]:
    """The first unit of each stage, from `parallel.pp_split_points` (the units stages 2..pp begin at, as
    torchtitan's `pipeline_parallel_split_points`). Refused, naming the field, unless there are pp - 1 of
    them, each a unit of this model, in order."""
    given = f"parallel.pp_split_points={list(split_points)}"
    if len(split_points) != pp - 1:
        raise ConfigError(f"{given} names {len(split_points)} units; parallel.pp={pp} needs {pp - 1} (where "
                          f"stages 2..{pp} begin)")
    unknown = [name for name in split_points if name not in names]
    if unknown:
        raise ConfigError(f"{given}: {', '.join(map(str, unknown))} is not a pipeline unit of this model; its "
                          f"units: {', '.join(names)}")
    starts = [0, *(names.index(name) for name in split_points)]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ConfigError(f"{given}: the units must be in model order, after the first ({names[0]}), each "
                          f"once; the units: {', '.join(names)}")
    return starts


def check_pipeline_stages(stages: int, units: int) -> None:
    if stages > units:
        raise ConfigError(f"parallel.pp={stages} stages but the model has only {units} pipeline units "
                          "(embedding, prelude layers, the core, coda layers, final norm, head)")


def check_replica_layout(model, *, tp: int, sp: bool, pp: int) -> None:
    """The depth-reuse baselines whose extra pieces are plain modules (MoR's routers, Ouro's exit head, RRT's
    per-recursion deltas) run with data parallelism only. `model` is a recipe mapping or a `GRTConfig`."""
    get = model.get if isinstance(model, Mapping) else (lambda name, default=None: getattr(model, name, default))
    check_mor_layout(get("routing", "none"), tp=tp, sp=sp, pp=pp)
    for field, active, name in (("exit_head", bool(get("exit_head", False)), "Ouro's exit head"),
                                ("lora_rank", int(get("lora_rank", 0) or 0) > 0, "RRT's per-recursion LoRA")):
        if active and (tp > 1 or sp or pp > 1):
            value = "true" if field == "exit_head" else get(field)
            raise ConfigError(f"model.{field}={value} ({name}) is not supported with tensor, sequence or pipeline "
                              f"parallelism (parallel.tp={tp}, pp={pp}): its modules are not split; use data "
                              "parallelism (ZeRO shards it)")


def check_mor_layout(routing: str, *, tp: int, sp: bool, pp: int) -> None:
    """MoR's routers are plain linears and its top-k is per sequence: it runs on data parallelism only."""
    if routing == "none":
        return
    if tp > 1 or sp:
        raise ConfigError(f"model.routing={routing!r} (MoR) is not supported with tensor or sequence "
                          f"parallelism (parallel.tp={tp}): its per-sequence top-k would need the whole "
                          "sequence on every rank; use data parallelism")
    if pp > 1:
        raise ConfigError(f"model.routing={routing!r} (MoR) is not supported with parallel.pp={pp}: its "
                          "auxiliary router loss and per-sequence top-k are not split into pipeline stages; "
                          "use data parallelism")


def validate_layout(*, world_size: int, tp: int, pp: int, sp: bool, zero_stage: int, model: Mapping,
                    seq_length: int, micro_batch: Optional[int], global_batch: int,
                    split_points: Optional[Sequence[str]] = None) -> int:
    """Refuse layouts that cannot work, with the reason, before anything is launched. `model` is the model
    recipe (a mapping); `split_points`, `parallel.pp_split_points`. Returns the data-parallel size."""
    dp = data_parallel_size(world_size, tp, pp)
    heads, hidden = model.get("num_attention_heads", 1), model.get("hidden_size", 1)
    ffn = model.get("ffn_hidden_size") or 4 * hidden
    for name, value in (("num_attention_heads", heads), ("hidden_size", hidden), ("ffn_hidden_size", ffn)):
        if value % tp:
            raise ConfigError(f"model.{name}={value} is not divisible by parallel.tp={tp}")
    if sp and tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1 (it shards activations over the TP group)")
    if sp and seq_length % tp:
        raise ConfigError(f"train.seq_length={seq_length} is not divisible by parallel.tp={tp} "
                          "(sequence parallelism shards the sequence)")
    if pp > 1 and zero_stage >= 2:
        raise ConfigError(f"deepspeed.zero_stage={zero_stage} cannot be combined with parallel.pp={pp}: "
                          "DeepSpeed's pipeline engine supports ZeRO 0 and 1 only")
    if zero_stage == 3 and (tp > 1 or pp > 1):
        raise ConfigError("deepspeed.zero_stage=3 needs parallel.tp=1 and parallel.pp=1 "
                          "(ZeRO 3 partitions parameters itself); use ZeRO 1 or 2 with tensor parallelism")
    check_replica_layout(model, tp=tp, sp=sp, pp=pp)
    if pp > 1:
        p, k, c = (int(model.get(f"{name}_layers", 1)) for name in ("prelude", "core", "coda"))
        dense = model.get("recurrences", 1) == 1 and model.get("gate") == "none" and model.get("injection") == "none"
        names = pipeline_unit_names(p, k, c, dense)
        check_pipeline_stages(pp, len(names))
        if split_points is not None:
            stage_starts_from_split_points(names, split_points, pp)
    elif split_points:
        raise ConfigError(f"parallel.pp_split_points={list(split_points)} needs parallel.pp > 1")
    if pp > 1 and zero_stage == 0:
        raise ConfigError(f"parallel.pp={pp} needs deepspeed.zero_stage=1: with ZeRO 0, DeepSpeed's pipeline "
                          "engine clips with a wrong gradient norm (tied and TP-replicated gradients "
                          "miscounted) and reports none")
    split_global_batch(global_batch, micro_batch, dp, f" ({world_size} processes / tp {tp} / pp {pp})")
    return dp
