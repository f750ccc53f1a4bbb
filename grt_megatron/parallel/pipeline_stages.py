"""How a pipeline-parallel model is cut into stages, decided from its config alone.

Pure (no DeepSpeed, no process group), so that grt-submit can print the stages a job will run before
queueing it, with the same code the pipeline builds them with (`GRTPipelineModule`, pipeline.py). The
units are `layout.pipeline_unit_names`; each costs its forward FLOPs per token (`model.flops`); stages
take contiguous units, balanced by cost, or begin where `parallel.pp_split_points` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.flops import pipeline_unit_flops
from grt_megatron.parallel.layout import check_pipeline_stages, pipeline_unit_names, stage_starts_from_split_points


@dataclass(frozen=True)
class PipelineStages:
    """A model's pipeline units in order, each one's forward FLOPs per token, and each stage's first unit."""

    names: list[str]
    costs: list[int]
    starts: list[int]

    @property
    def split_points(self) -> list[str]:
        """The units stages 2..pp begin at, as `parallel.pp_split_points` names them."""
        return [self.names[i] for i in self.starts[1:]]

    def describe(self) -> str:
        """Each stage's units and its share of the forward FLOPs, as grt-train and grt-submit print them:
        `embedding layer.0 (12%) | core (61%) | layer.2 final_norm head (27%)`."""
        bounds = [*self.starts, len(self.names)]
        total = sum(self.costs) or 1
        return " | ".join(f"{' '.join(self.names[a:b])} ({100 * sum(self.costs[a:b]) / total:.0f}%)"
                          for a, b in zip(bounds, bounds[1:]))


def plan_pipeline_stages(config: GRTConfig, seq_len: int, pp: int,
                         split_points: Optional[Sequence[str]] = None) -> PipelineStages:
    """The `pp` stages of `config`'s model: balanced by forward FLOPs (`balanced_stage_starts`), or begun
    at `split_points` (checked: refused with the units listed)."""
    names = pipeline_unit_names(config.prelude_layers, config.core_layers, config.coda_layers, config.is_dense)
    costs = pipeline_unit_flops(config, seq_len, names)
    starts = (balanced_stage_starts(costs, pp) if split_points is None
              else stage_starts_from_split_points(names, split_points, pp))
    return PipelineStages(names, costs, starts)


def balanced_stage_starts(costs: Sequence[int], stages: int) -> list[int]:
    """Contiguous, non-empty stages: first the costliest stage as cheap as it can be (the pipeline's
    pace), then, among those splits, the smallest sum of squared stage costs, so the cheap units spread out
    instead of a stage holding the embedding alone (ties: the same split every time). Exact, in integers."""
    n = len(costs)
    check_pipeline_stages(stages, n)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def split(value_of):
        """Dynamic programme over (stages so far, units so far); `value_of(previous, stage cost)`."""
        best = [[None] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for j in range(1, stages + 1):
            for i in range(j, n - (stages - j) + 1):
                for start in range(j - 1, i):
                    if best[j - 1][start] is None:
                        continue
                    value = value_of(best[j - 1][start], prefix[i] - prefix[start])
                    if value is not None and (best[j][i] is None or value < best[j][i]):
                        best[j][i], cut[j][i] = value, start
        starts, i = [], n
        for j in range(stages, 0, -1):
            i = cut[j][i]
            starts.append(i)
        return best[stages][n], starts[::-1]

    pace, _ = split(max)
    return split(lambda total, stage: None if stage > pace else total + stage * stage)[1]
