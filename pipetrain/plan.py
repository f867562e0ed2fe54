"""From a Config to what runs: the validated schedule and the per-stage costs.

The same Plan feeds `mode=simulate` and (later) the executor, so what is
simulated is exactly what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.config import Config, SleepModelConfig
from pipetrain.models.costs import LayerCost, chunk_costs
from pipetrain.models.sleep import sleep_layer_costs
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.simulate import StageCosts
from pipetrain.schedules.spec import RankCosts
from pipetrain.schedules.validate import validate


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    layer_costs: tuple[LayerCost, ...]
    chunk_bounds: tuple[range, ...]  # model chunk -> layer indices
    stage_costs: StageCosts
    rank_costs: RankCosts  # one microbatch through the heaviest rank's share
    analytic_bubble: float | None  # published idle time per rank (ms), where a formula exists


def build_schedule(config: Config) -> Schedule:
    s, p = config.schedule, config.pipeline
    if s.name == registry.CUSTOM:
        schedule = registry.load_custom(
            s.path, num_ranks=p.degree, num_microbatches=p.microbatches,
            placement=s.placement, virtual_stages=s.virtual_stages,
        )
    else:
        schedule = registry.build(s.name, p.degree, p.microbatches, s.virtual_stages)
    validate(schedule)
    return schedule


def layer_costs(config: Config) -> list[LayerCost]:
    m = config.model
    if isinstance(m, SleepModelConfig):
        return sleep_layer_costs(layers=m.layers, f_ms=m.f_ms, b_ms=m.b_ms, w_ms=m.w_ms, hidden=m.hidden)
    raise ValueError(f"model={m.name} has no cost model: choose model=sleep")


def make_plan(config: Config) -> Plan:
    schedule = build_schedule(config)
    costs = layer_costs(config)
    bounds = uniform_bounds(len(costs), schedule.placement.num_chunks)
    stage_costs = StageCosts.from_chunks(schedule, chunk_costs(costs, bounds))
    rc = registry.rank_costs(
        schedule, list(stage_costs.f), list(stage_costs.b), list(stage_costs.w), config.sim.fb_overlap
    )
    analytic = None
    if config.schedule.name != registry.CUSTOM:
        formula = registry.get(config.schedule.name).analytic_bubble
        if formula is not None:
            analytic = formula(schedule.num_ranks, schedule.placement.stages_per_rank, rc)
    return Plan(schedule, tuple(costs), tuple(bounds), stage_costs, rc, analytic)
