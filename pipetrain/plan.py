"""From a Config to what runs: the validated schedule, the partition and the per-stage costs.

The same Plan feeds `mode=simulate` and the run, so what is simulated is exactly what runs, and
the partition table and the simulation read the same numbers (the stage costs are the partition's
chunk sums). From the partition on, make_plan and the planner (planner/search.py) take one path:
`simulate_layout(LayoutInputs) -> SimulatedPlan` (costs, zb_auto's search, the lowering passes, the
gradient reductions, the simulation); the planner only varies its inputs, one set per candidate.

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
import math
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Sequence

from pipetrain.config import Config, ModelConfig, SleepModelConfig
from pipetrain.execution import (compiled_stages, cost_source, measures_here, overlap_on, pairs_fb, profile_device,
                                 recompute_stages)
from pipetrain.partition.costs import LayerCost, chunk_costs, cp_layer_costs, ep_layer_costs
from pipetrain.models.costs import config_layer_costs
from pipetrain.partition.partition import Partition, require_chunks
from pipetrain.partition.strategies import partition
from pipetrain.planner.compute import Timing, layer_times
from pipetrain.schedules import registry
from pipetrain.schedules.fb_pairs import LayerNodes
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.lower import pair_fb
from pipetrain.schedules.reduce import add_reduces
from pipetrain.schedules.reduce_cost import reduce_ms, stage_params
from pipetrain.schedules.simulate import SimResult, StageCosts, simulate, split_stages
from pipetrain.schedules.spec import RankCosts
from pipetrain.schedules.tp_cost import tp_layer_costs
from pipetrain.schedules.validate import validate
from pipetrain.schedules.zb_auto import zb_auto_order

if TYPE_CHECKING:  # torch-typed names only; importing them at run time would load torch
    from pipetrain.models.base import LayeredModel


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    partition: Partition  # chunk -> layer range, with the layer costs it was cut by
    stage_costs: StageCosts  # per stage id, from partition.chunk_fbw() through the placement
    rank_costs: RankCosts  # one microbatch through the heaviest rank's share
    analytic_bubble: float | None  # published idle time per rank (ms), where a formula exists
    cost_source: str  # "sleep" (configured), "analytic" (FLOPs at sim.tflops) or "measured:<device>"
    # Data parallel: per stage id, the ms its gradient reduction keeps a rank's communication
    # lane busy (bytes over cluster.dp_bandwidth_gbs, schedules/reduce_cost.py); None when dp = 1.
    reduce_ms: tuple[float, ...] | None = None
    # stage ids whose layers recompute (trainer.activation_checkpointing)
    recompute_stages: frozenset[int] = frozenset()
    # stage ids whose layers are compiled (trainer.compile); their B and W stay apart (runtime/backward.py)
    compiled_stages: frozenset[int] = frozenset()
    # what simulate_layout returned for this plan: `simulated.result` is mode=simulate's simulation
    simulated: SimulatedPlan | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def layer_costs(self) -> tuple[LayerCost, ...]:
        return self.partition.layers

    @property
    def chunk_bounds(self) -> tuple[range, ...]:  # model chunk -> layer indices
        return self.partition.bounds


# ---- the one path from a layout to a simulated schedule ----------------------------------------
# make_plan (mode=simulate and the run) and the planner (planner/search.py, which varies the inputs
# per candidate) both call simulate_layout, so a rule about costs, lowering or reductions is written once.


@dataclass(frozen=True)
class GradReduce:
    """Data parallel: how each stage's gradient reduction is placed and timed (schedules/reduce_cost.py)."""

    dp_replicate: int
    dp_shard: int
    bandwidth_gbs: float  # per rank (cluster.dp_bandwidth_gbs, plan.dp_gbs)
    reduce_dtype: str
    at_end: bool = False  # all after the rank's last action (parallel.overlap_reduce=false), else after each last W
    latency_ms: float = 0.0  # added to every stage's reduction (plan.reduce_latency_ms)
    # share of the stage's last backward (one microbatch's B + W) the reduction runs under, bucket by bucket as its
    # layers finish (plan.grad_overlap); 0: it starts at the stage's REDUCE_GRAD, as pipetrain's reducer does
    overlap: float = 0.0


@dataclass(frozen=True)
class LayoutInputs:
    """One pipeline layout, everything simulate_layout reads: a run's config gives one (layout_inputs),
    the planner one per candidate."""

    schedule: str  # a registry name; zb_auto is searched for these costs
    degree: int  # pipeline ranks
    microbatches: int
    virtual_stages: int
    partition: Partition  # one tp rank's per-layer costs of one microbatch, cut into the placement's chunks
    recompute_stages: frozenset[int] = frozenset()  # their backward passes run the forward again
    recompute_modules: tuple[str, ...] = ()  # trainer.recompute=selective: only these modules, in B (else full)
    comm_ms: float = 0.0  # per cross-rank transfer
    fb_overlap: float = 0.0  # sim.fb_overlap
    # pipeline.fb_overlap on or auto: an F&B pair of stages with all-to-alls costs its layers' nodes as the
    # executor interleaves them (StageCosts.layers, schedules/fb_pairs.py) instead of the scalar above
    overlap_layers: bool = False
    action_overhead_ms: float = 0.0  # the executor's own time per F, B, W or BW (plan.action_overhead_ms)
    w_keep: float = 1.0  # share of a microbatch's activations B keeps for W (zb_auto's memory model)
    memory_budget: Sequence[float] | None = None  # zb_auto: activations per rank, in microbatches (None: 2P-1)
    grad_reduce: GradReduce | None = None  # data parallel; None when dp = 1


@dataclass(frozen=True)
class SimulatedPlan:
    """What simulate_layout returns: the schedule that runs, what its actions cost, and (on first
    read, `result`) its simulation."""

    schedule: Schedule  # lowered: F&B pairs and, under data parallel, the reductions placed
    stage_costs: StageCosts  # per stage id
    reduce_ms: tuple[float, ...] | None  # per stage id, its gradient reduction; None without data parallel
    w_keep: tuple[float, ...]  # per stage id, the share B keeps for W (all of it where W recomputes)
    comm_ms: float
    fb_overlap: float

    @functools.cached_property
    def result(self) -> SimResult:
        return simulate(self.schedule, self.stage_costs, comm_ms=self.comm_ms, fb_overlap=self.fb_overlap,
                        check=False, reduce_ms=self.reduce_ms)

    def __getstate__(self) -> dict:  # a Plan sent to the ranks leaves the simulation (10^6 steps at P=10^4) behind
        return {k: v for k, v in self.__dict__.items() if k != "result"}


def simulate_layout(inputs: LayoutInputs, *, built: Schedule | None = None) -> SimulatedPlan:
    """Costs -> schedule -> lowering -> reductions for one layout; pure, no torch, not validated (the
    caller validates what runs). `built`: the schedule built already (make_plan's, validated; a custom
    CSV), lowered and costed here instead of built; zb_auto is searched for `inputs`' own costs."""
    pl = registry.placement_for(inputs.schedule, inputs.degree, inputs.virtual_stages) if built is None \
        else built.placement
    num_stages = pl.num_stages
    keep = tuple(1.0 if s in inputs.recompute_stages and not inputs.recompute_modules else inputs.w_keep
                 for s in range(num_stages))  # a W that recomputes does so from everything B kept
    if built is None and inputs.schedule == "zb_auto":
        registry.check(inputs.schedule, inputs.degree, inputs.microbatches, inputs.virtual_stages)
        search = layout_stage_costs(inputs, pl, set(range(num_stages)))
        steps = zb_auto_order(inputs.degree, inputs.microbatches, f=search.f, b=search.b, w=search.w,
                              comm=inputs.comm_ms, budget=inputs.memory_budget, w_keep=list(keep))
        built = Schedule.build(inputs.schedule, pl, inputs.microbatches, steps)
    elif built is None:
        built = registry.build(inputs.schedule, inputs.degree, inputs.microbatches, inputs.virtual_stages)
    schedule = lower(built, inputs.grad_reduce,
                     pair=inputs.overlap_layers and any(l.comm_f_ms or l.comm_b_ms for l in inputs.partition.layers))
    # which stages run W apart from B decides what recompute and the per-action overhead add to W
    split = split_stages(schedule) if inputs.recompute_stages or inputs.action_overhead_ms else set()
    costs = layout_stage_costs(inputs, pl, split)
    red = None
    if inputs.grad_reduce is not None:
        g = inputs.grad_reduce
        red = reduce_ms(stage_params(schedule, inputs.partition.chunk_params()), dp_replicate=g.dp_replicate,
                        dp_shard=g.dp_shard, bandwidth_gbs=g.bandwidth_gbs, reduce_dtype=g.reduce_dtype)
        if g.latency_ms:
            red = tuple(r + g.latency_ms for r in red)
        if g.overlap:
            red = tuple(max(r - g.overlap * (costs.b[s] + costs.w[s]), 0.0) for s, r in enumerate(red))
    return SimulatedPlan(schedule, costs, red, keep, inputs.comm_ms, inputs.fb_overlap)


def layout_stage_costs(inputs: LayoutInputs, pl: Placement, split: Collection[int]) -> StageCosts:
    """Per stage id (f, b, w) of one microbatch: the chunk's layers summed (a compiled stage's alike: its
    B and W stay apart, runtime/backward.py); a recomputing stage's
    backward passes run its forward again (in W too on the stages in `split`, StageCosts.with_recompute);
    inputs.action_overhead_ms added to every action (to W on the stages in `split` only)."""
    part = inputs.partition
    chunks = chunk_costs(part.layers, part.bounds)
    per_stage = [chunks[pl.chunk_of(s)] for s in range(pl.num_stages)]
    layers = overlap_layers(inputs, pl) if inputs.overlap_layers else ()
    # all-to-alls priced as bytes over one link's bandwidth queue on it (meaningful only with layers)
    costs = StageCosts(*(tuple(c[i] for c in per_stage) for i in range(3)), layers=layers, one_link=bool(layers))
    if inputs.recompute_stages and inputs.recompute_modules:  # selective: B re-runs the modules' share of f
        again = [math.fsum(part.layers[i].selective(inputs.recompute_modules)[1] for i in part.bounds[pl.chunk_of(s)])
                 for s in range(pl.num_stages)]
        costs = costs.with_selective(again, inputs.recompute_stages)
    elif inputs.recompute_stages:
        costs = costs.with_recompute(split, inputs.recompute_stages)
    extra = inputs.action_overhead_ms
    if not extra:
        return costs
    n = pl.num_stages
    return dataclasses.replace(costs, f=tuple(f + extra for f in costs.f), b=tuple(b + extra for b in costs.b),
                               w=tuple(w + (extra if s in split else 0.0) for s, w in enumerate(costs.w)),
                               bw=tuple(costs.fused(s) + extra for s in range(n)))  # a BW is one action


def overlap_layers(inputs: LayoutInputs, pl: Placement) -> tuple[tuple[LayerNodes, ...], ...]:
    """Per stage id, per layer, its node times (schedules/fb_pairs.py LayerNodes.split of the layer's f, b,
    w, all-to-all and experts share): the F&B overlap model's input (StageCosts.layers); () when no layer
    has an all-to-all (dense models keep the scalar sim.fb_overlap). A BW carries each layer's w in its nodes
    (LayerNodes.backward)."""
    part = inputs.partition
    if not any(l.comm_f_ms or l.comm_b_ms for l in part.layers):
        return ()
    nodes = [LayerNodes.split(f_ms=l.f_ms, b_ms=l.b_ms, w_ms=l.w_ms, comm_f_ms=l.comm_f_ms, comm_b_ms=l.comm_b_ms,
                              experts_share=l.experts_flops_share, post_share=l.shared_experts_flops_share)
             for l in part.layers]
    return tuple(tuple(nodes[i] for i in part.bounds[pl.chunk_of(s)]) for s in range(pl.num_stages))


def lower(schedule: Schedule, grad_reduce: GradReduce | None, *, pair: bool = False) -> Schedule:
    """Every run-time change to a schedule, in order: with `pair` (F&B overlap of all-to-alls:
    `pairs_fb`) a forward followed by another microbatch's backward becomes an F&B pair (Megatron's
    combined 1F1B), then under data parallel each stage's gradient reduction is placed after its last W
    or BW (or at the end).
    Lowered twice is lowered once."""
    if pair:
        schedule = pair_fb(schedule)
    if grad_reduce is not None:
        schedule = add_reduces(schedule, at_end=grad_reduce.at_end)
    return schedule


def build_schedule(config: Config) -> Schedule:
    """The run's validated schedule, lowered (`lower`): F&B pairs where they run, then under data
    parallel the gradient reductions placed (a compiled stage keeps its B and W: runtime/backward.py).
    `zb_auto` is searched here for unit costs; make_plan searches it again for the run's own (simulate_layout)."""
    s, p = config.schedule, config.pipeline
    if s.name == registry.CUSTOM:
        schedule = registry.load_custom(
            s.path, num_ranks=p.degree, num_microbatches=p.microbatches,
            placement=s.placement, virtual_stages=s.virtual_stages,
        )
    else:
        schedule = registry.build(s.name, p.degree, p.microbatches, s.virtual_stages)
    schedule = lower(schedule, grad_reduce(config), pair=pairs_fb(config))
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


def layer_costs(config: Config) -> list[LayerCost]:
    """Per-layer costs of one microbatch (config.microbatch_size x data.seq_len) on one rank
    of this run: under parallel.tp, its 1/tp of the compute plus the layer's TP collectives; under
    parallel.cp, its 1/cp of the sequence plus the K/V exchanges; under parallel.ep, the MoE layers'
    all-to-alls added and 1/ep of their experts stored (partition/costs.py)."""
    par, m, cl = config.parallel, config.model, config.cluster
    seq = seq_len(config)
    bytes_per_value = 2 if config.trainer.precision == "bf16" else 4
    tokens = config.microbatch_size * seq
    costs = cp_layer_costs(whole_layer_costs(config), cp=par.cp, tokens=tokens, bytes_per_value=bytes_per_value,
                           bandwidth_gbs=cl.cp_bandwidth_gbs, rotate=par.cp_rotate)
    # a rank dispatches its own tokens: 1/cp of the microbatch's under context parallel (experts folded over cp),
    # and 1/tp of those where the experts are whole (etp = 1: ep over the tp ranks, which share their tokens)
    etp = config.layout.etp
    costs = ep_layer_costs(costs, ep=par.ep, tokens=tokens // (par.cp * (par.tp // etp)),
                           bytes_per_value=bytes_per_value, bandwidth_gbs=cl.ep_bandwidth_gbs)
    if par.tp == 1:
        return costs
    return tp_layer_costs(costs, tp=par.tp, tokens=tokens, hidden=m.hidden_size,
                          vocab=m.vocab_size or 0, bytes_per_value=bytes_per_value,
                          bandwidth_gbs=config.cluster.tp_bandwidth_gbs, sequence_parallel=par.sequence_parallel,
                          etp=etp)


def whole_layer_costs(config: Config) -> list[LayerCost]:
    """Per-layer costs of one microbatch of the unsplit layers (no tensor parallel)."""
    m, mbs = config.model, config.microbatch_size
    if config.partition.name == "profile" and measures_here(config):
        return measured_layer_costs(config, build_model(m, device="meta"), microbatch=mbs)
    return model_layer_costs(m, microbatch=mbs, seq=seq_len(config), tflops=config.sim.tflops)


# The one home of a layer's cost, for mode=simulate and the run (whole_layer_costs above) and the
# planner (planner/cmd.py workload): by formula (model_layer_costs) or measured here (measured_layer_costs).
def seq_len(config: Config) -> int:
    """Tokens per sample a layer's cost is for: data.seq_len for a language model, else 1."""
    return config.data.seq_len if config.model.has_seq else 1


def costing_model(m: ModelConfig) -> LayeredModel | None:
    """The model built on meta (shapes and dtypes only: no parameter memory) for the planner to time layer by
    layer where it measures (plan.calibrate, partition=profile: planner/cmd.py workload); None for model=sleep.
    Costs by formula need no model (model_layer_costs; models/costs.py)."""
    return None if isinstance(m, SleepModelConfig) else build_model(m, device="meta")


def model_layer_costs(m: ModelConfig, *, microbatch: int, seq: int, tflops: float, timing: Timing | None = None,
                      tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> list[LayerCost]:
    """Per-layer costs of one microbatch of the unsplit layers by formula, from the config alone (no torch:
    models/costs.py): the sleep model's given times (whatever the microbatch), else the family's FLOPs at
    `tflops` TFLOP/s; with `timing` (plan.device), each layer's GEMMs, attention and element-wise bytes on that
    device as one tp x cp rank runs them (planner/compute.py layer_times, scaled to the whole layer)."""
    if timing is None:
        return config_layer_costs(m, microbatch=microbatch, seq=seq, tflops=tflops)
    return [layer_times(layer, tokens=microbatch * seq, seq=seq, t=timing, tp=tp, cp=cp,
                        sequence_parallel=sequence_parallel)
            for layer in config_layer_costs(m, microbatch=microbatch, seq=seq, tflops=timing.sustained_tflops)]


def measured_layer_costs(config: Config, model: LayeredModel, *, microbatch: int) -> list[LayerCost]:
    """Per-layer costs of one microbatch of `model`'s unsplit layers, timed one layer at a time where the
    ranks compute (partition=profile, plan.calibrate)."""
    from pipetrain.models.profile import profile_layers

    return profile_layers(model, batch=microbatch, seq=seq_len(config), device=profile_device(config),
                          threads=config.trainer.threads_per_rank, precision=config.trainer.precision)


def make_partition(config: Config, layers: list[LayerCost], num_chunks: int) -> Partition:
    p = config.partition
    if p.name == "profile":  # balance the measured f + b + w, and say where the cut came from
        return dataclasses.replace(partition(layers, num_chunks, "time"), strategy="profile")
    return partition(layers, num_chunks, p.name, boundaries=p.boundaries)


def make_plan(config: Config) -> Plan:
    schedule = build_schedule(config)  # validated before anything is built (or profiled)
    require_chunks(config.model.num_layers, schedule.placement.num_chunks)  # so are too many stages
    part = make_partition(config, layer_costs(config), schedule.placement.num_chunks)
    searched = config.schedule.name == "zb_auto"  # searched again for this run's costs (same placement)
    inputs = layout_inputs(config, part, schedule.placement.num_stages)
    laid = simulate_layout(inputs, built=None if searched else schedule)
    if searched:
        validate(laid.schedule, p2p_lookahead=config.pipeline.p2p_lookahead,
                 p2p_transport=config.pipeline.p2p_transport)
    schedule, costs = laid.schedule, laid.stage_costs
    rc = registry.rank_costs(schedule, list(costs.f), list(costs.b), list(costs.w), config.sim.fb_overlap)
    analytic = None
    if config.schedule.name != registry.CUSTOM:
        formula = registry.get(config.schedule.name).analytic_bubble
        if formula is not None:
            analytic = formula(schedule.num_ranks, schedule.placement.stages_per_rank, rc)
    return Plan(schedule, part, costs, rc, analytic, cost_source(config), laid.reduce_ms, inputs.recompute_stages,
                compiled_stages(config, schedule.placement.num_stages), laid)


def layout_inputs(config: Config, part: Partition, stages: int) -> LayoutInputs:
    """What a run's config gives the one path (the planner gives its candidates'), for `stages` stage ids."""
    s, p = config.schedule, config.pipeline
    budget = budget_of(s.memory_budget, p.degree) if s.name == "zb_auto" else None
    return LayoutInputs(s.name, p.degree, p.microbatches, s.virtual_stages, part,
                        recompute_stages=recompute_stages(config, stages),
                        recompute_modules=tuple(config.trainer.recompute_modules)
                        if config.trainer.recompute == "selective" else (),
                        comm_ms=config.sim.comm_ms, fb_overlap=config.sim.fb_overlap, w_keep=s.w_keep,
                        memory_budget=budget, grad_reduce=grad_reduce(config),
                        overlap_layers=overlap_on(config))


def grad_reduce(config: Config) -> GradReduce | None:
    """The data-parallel gradient reductions a config runs (None when dp = cp = 1; context parallel's
    ranks shard the parameters with dp_shard's)."""
    layout = config.layout
    if layout.dp_mode == "none":
        return None
    return GradReduce(layout.dp_replicate, layout.dp_shard * layout.cp, config.cluster.dp_bandwidth_gbs,
                      config.parallel.reduce_dtype, at_end=not config.parallel.overlap_reduce)


