"""From a Config to what runs: the validated schedule, the partition and the per-stage costs.

The same Plan feeds `mode=simulate` and (later) the executor, so what is simulated is
exactly what runs, and the partition table and the simulation read the same numbers
(the stage costs are the plan's own `chunk_fbw()`).

Where layer costs come from:
  - model=sleep: its configured times, in pure Python (the sleep + any analytic partition
    path never imports torch);
  - real models (gpt2*, mlp): the model's analytic cost model, built on torch's meta
    device, so even gpt2-xl allocates no parameter memory; FLOPs become ms at sim.tflops;
  - partition=profile: every layer is timed on this machine, one layer at a time (built on meta,
    each materialised, timed and freed: models/profile.py), on the device the ranks train on (the
    current CUDA device, or CPU), under the run's autocast, at the run's microbatch x data.seq_len.
    Under cluster=torchrun / slurm / submitit every rank process plans before any process group
    exists: only global rank 0 measures; the others plan on the analytic costs as a stand-in and
    take rank 0's plan when the ranks start (launch/rank.py `_agree_with_rank0`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipetrain.config import Config, ModelConfig, SleepModelConfig
from pipetrain.partition.costs import LayerCost, chunk_costs, fuse_weight_grads
from pipetrain.models.sleep import sleep_layer_costs
from pipetrain.partition.plan import PartitionPlan, require_chunks
from pipetrain.partition.strategies import partition
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.lower import fuse_backward
from pipetrain.schedules.reduce import add_reduces
from pipetrain.schedules.reduce_cost import reduce_ms, stage_params
from pipetrain.schedules.simulate import StageCosts, split_stages
from pipetrain.schedules.spec import RankCosts
from pipetrain.schedules.tp_cost import tp_layer_costs
from pipetrain.schedules.validate import validate
from pipetrain.schedules.zb_auto import zb_auto_order

if TYPE_CHECKING:  # torch-typed names only; importing them at run time would load torch
    from pipetrain.models.base import LayeredModel


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    partition: PartitionPlan  # chunk -> layer range, with the layer costs it was cut by
    stage_costs: StageCosts  # per stage id, from partition.chunk_fbw() through the placement
    rank_costs: RankCosts  # one microbatch through the heaviest rank's share
    analytic_bubble: float | None  # published idle time per rank (ms), where a formula exists
    cost_source: str  # "sleep" (configured), "analytic" (FLOPs at sim.tflops) or "measured:<device>"
    # Data parallel: per stage id, the ms its gradient reduction keeps a rank's communication
    # lane busy (bytes over cluster.dp_bandwidth_gbs, schedules/reduce_cost.py); None when dp = 1.
    reduce_ms: tuple[float, ...] | None = None
    recompute_stages: frozenset[int] = frozenset()  # stage ids whose layers recompute (trainer.activation_checkpointing)
    compiled_stages: frozenset[int] = frozenset()  # stage ids whose layers are compiled (trainer.compile): BW, no W

    @property
    def layer_costs(self) -> tuple[LayerCost, ...]:
        return self.partition.layers

    @property
    def chunk_bounds(self) -> tuple[range, ...]:  # model chunk -> layer indices
        return self.partition.bounds


def build_schedule(config: Config, stage_costs: StageCosts | None = None) -> Schedule:
    """The run's validated schedule, lowered: a compiled stage's B is BW and its W gone (schedules/lower.py),
    then under data parallel the gradient reductions placed. `zb_auto` is searched for `stage_costs` (the
    run's own F, B, W per stage and sim.comm_ms) when given; without them, for unit costs."""
    s, p = config.schedule, config.pipeline
    if s.name == "zb_auto" and stage_costs is not None:
        registry.check(s.name, p.degree, p.microbatches, s.virtual_stages)
        # compiled: searched on B = b + w, W = 0 (lowered to BW below), no W recomputing from what B kept
        rc = recompute_stages(config, p.degree) if not config.trainer.compile else frozenset()
        keep = [1.0 if j in rc else s.w_keep for j in range(p.degree)]  # W recomputes from what B kept
        steps = zb_auto_order(p.degree, p.microbatches, f=stage_costs.f, b=stage_costs.b, w=stage_costs.w,
                              comm=config.sim.comm_ms, budget=budget_of(s.memory_budget, p.degree), w_keep=keep)
        schedule = Schedule.build(s.name, registry.placement_for(s.name, p.degree), p.microbatches, steps)
    elif s.name == registry.CUSTOM:
        schedule = registry.load_custom(
            s.path, num_ranks=p.degree, num_microbatches=p.microbatches,
            placement=s.placement, virtual_stages=s.virtual_stages,
        )
    else:
        schedule = registry.build(s.name, p.degree, p.microbatches, s.virtual_stages)
    schedule = fuse_backward(schedule, compiled_stages(config, schedule.placement.num_stages))
    if config.layout.dp_mode != "none":  # each stage's gradients reduced over dp (x cp) once, after its last W or BW (or at the end)
        schedule = add_reduces(schedule, at_end=not config.parallel.overlap_reduce)
    validate(schedule, p2p_lookahead=p.p2p_lookahead, p2p_transport=p.p2p_transport)
    return schedule


def budget_of(memory_budget: list[float] | None, degree: int) -> list[float] | None:
    """schedule.memory_budget as one budget per rank (one value: the same for all)."""
    if memory_budget is None or len(memory_budget) == degree:
        return memory_budget
    if len(memory_budget) == 1:
        return list(memory_budget) * degree
    raise ValueError(f"schedule.memory_budget lists {len(memory_budget)} budgets: give one for all ranks or "
                     f"pipeline.degree={degree} (one per rank)")


def build_model(model: ModelConfig, *, device: Any = None) -> LayeredModel:
    """The runnable model a model config describes, built on `device` ("meta": shapes only)."""
    import torch

    from pipetrain.models.factory import build_model as build

    with torch.device(device if device is not None else "cpu"):
        return build(model.family, **model.knobs())


def profile_device(config: Config) -> str:
    """Where partition=profile measures: where the ranks compute (trainer.device), on CUDA the current
    device ("cuda:0" in the launcher and in rank 0 before set_device; never every rank's GPU 0)."""
    import torch

    if run_device(config) == "cpu":
        return "cpu"
    return f"cuda:{torch.cuda.current_device()}"


def run_device(config: Config) -> str:
    """Where this run's ranks compute: trainer.device, its auto resolved as the ranks resolve it."""
    if config.trainer.device != "auto":
        return config.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def measures_here(config: Config) -> bool:
    """Whether this process times the layers of partition=profile: yes, unless it is a rank other than
    0 of a launch whose every rank plans (torchrun, slurm, submitit): 8 processes of a node building
    layers on one GPU at once would contend (and once ran out of memory); rank 0's plan is the one
    the ranks run (launch/rank.py broadcasts it)."""
    from pipetrain.launch.resolvers import process_rank

    return process_rank(config.cluster.name) == 0


def cost_source(config: Config) -> str:
    if config.partition.name == "profile" and measures_here(config):
        return f"measured:{profile_device(config)}"
    return "sleep" if isinstance(config.model, SleepModelConfig) else "analytic"


def layer_costs(config: Config) -> list[LayerCost]:
    """Per-layer costs of one microbatch (config.microbatch_size x data.seq_len) on one rank
    of this run: under parallel.tp, its 1/tp of the compute plus the layer's TP collectives."""
    costs = whole_layer_costs(config)
    par, m = config.parallel, config.model
    if par.tp == 1:
        return costs
    seq = config.data.seq_len if m.has_seq else 1
    hidden = getattr(m, "hidden", None) or getattr(m, "n_embd", None) or m.hidden_size  # sleep / gpt2 / llama
    bytes_per_value = 2 if config.trainer.precision == "bf16" else 4
    return tp_layer_costs(costs, tp=par.tp, tokens=config.microbatch_size * seq, hidden=hidden,
                          vocab=getattr(m, "vocab_size", 0), bytes_per_value=bytes_per_value,
                          bandwidth_gbs=config.cluster.tp_bandwidth_gbs, sequence_parallel=par.sequence_parallel)


def whole_layer_costs(config: Config) -> list[LayerCost]:
    """Per-layer costs of one microbatch of the unsplit layers (no tensor parallel)."""
    m, seq = config.model, (config.data.seq_len if config.model.has_seq else 1)
    if config.partition.name == "profile" and measures_here(config):
        from pipetrain.models.profile import profile_layers

        return profile_layers(build_model(m, device="meta"), batch=config.microbatch_size, seq=seq,
                              device=profile_device(config), threads=config.trainer.threads_per_rank,
                              precision=config.trainer.precision)
    if isinstance(m, SleepModelConfig):
        return sleep_layer_costs(layers=m.layers, f_ms=m.f_ms, b_ms=m.b_ms, w_ms=m.w_ms, hidden=m.hidden,
                                 params_per_layer=m.params_per_layer)
    model = build_model(m, device="meta")  # shapes and dtypes only: no parameter memory
    return model.cost_model(microbatch=config.microbatch_size, seq=seq, tflops=config.sim.tflops)


def make_partition(config: Config, layers: list[LayerCost], num_chunks: int) -> PartitionPlan:
    p = config.partition
    if p.name == "profile":  # balance the measured f + b + w, and say where the cut came from
        return dataclasses.replace(partition(layers, num_chunks, "time"), strategy="profile")
    return partition(layers, num_chunks, p.name, boundaries=p.boundaries)


def make_plan(config: Config) -> Plan:
    schedule = build_schedule(config)
    # Fail on too many stages before building (or profiling) anything.
    require_chunks(config.model.num_layers, schedule.placement.num_chunks)
    costs = layer_costs(config)
    part = make_partition(config, costs, schedule.placement.num_chunks)
    chunks = part.chunk_fbw()
    if config.trainer.compile:  # B = b + w, W = 0: zb_auto's search input (a BW costs b + w)
        chunks = chunk_costs(fuse_weight_grads(part.layers), part.bounds)
    stage_costs = StageCosts.from_chunks(schedule, chunks)
    recompute = recompute_stages(config, schedule.placement.num_stages)
    if recompute:  # their backward passes run the forward again (in a W too, on the stages still running one)
        stage_costs = stage_costs.with_recompute(split_stages(schedule), recompute)
    if config.schedule.name == "zb_auto":  # searched for this run's costs (same placement, so same stage costs)
        schedule = build_schedule(config, stage_costs)
    rc = registry.rank_costs(
        schedule, list(stage_costs.f), list(stage_costs.b), list(stage_costs.w), config.sim.fb_overlap
    )
    analytic = None
    if config.schedule.name != registry.CUSTOM:
        formula = registry.get(config.schedule.name).analytic_bubble
        if formula is not None:
            analytic = formula(schedule.num_ranks, schedule.placement.stages_per_rank, rc)
    return Plan(schedule, part, stage_costs, rc, analytic, cost_source(config), plan_reduce_ms(config, schedule, part),
                recompute, compiled_stages(config, schedule.placement.num_stages))


def compiled_stages(config: Config, num_stages: int) -> frozenset[int]:
    """The stage ids whose layers are compiled: every stage under trainer.compile, else none."""
    return frozenset(range(num_stages)) if config.trainer.compile else frozenset()


def recompute_stages(config: Config, num_stages: int) -> frozenset[int]:
    """The stage ids that recompute: none without trainer.activation_checkpointing, else
    trainer.recompute_stages (every stage when null), each checked against the schedule's stages."""
    t = config.trainer
    if not t.activation_checkpointing:
        return frozenset()
    if t.recompute_stages is None:
        return frozenset(range(num_stages))
    bad = [s for s in t.recompute_stages if s >= num_stages]
    if bad:
        raise ValueError(f"trainer.recompute_stages={list(t.recompute_stages)}: stage {bad[0]} does not exist, the "
                         f"schedule has stages 0..{num_stages - 1}: list stage ids below {num_stages}")
    return frozenset(t.recompute_stages)


def plan_reduce_ms(config: Config, schedule: Schedule, part: PartitionPlan) -> tuple[float, ...] | None:
    """Per stage, the simulated ms of its data-parallel gradient reduction (None without data parallel)."""
    layout = config.layout
    if layout.dp_mode == "none":
        return None
    return reduce_ms(stage_params(schedule, part.chunk_params()), dp_replicate=layout.dp_replicate,
                     dp_shard=layout.dp_shard * layout.cp, bandwidth_gbs=config.cluster.dp_bandwidth_gbs,
                     reduce_dtype=config.parallel.reduce_dtype)
