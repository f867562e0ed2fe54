"""From every rank's measurements of one step to the numbers a user compares with the paper.

  - One time axis: every rank leaves the step's closing loss all-reduce at the same moment,
    `sync_ms` after its own step began on its own clock, so rank r began max(sync_ms) -
    sync_ms[r] after the earliest. No host clock enters (across hosts they disagree by
    milliseconds; on GPU the host's time is when work was queued, not run). The step's
    makespan runs from the earliest rank's start to the last action's end on any rank, the
    same definition the simulator uses (every rank ready at 0, makespan = last end).
  - Measured bubble of rank r = 1 - compute busy time / makespan, busy time being the sum of
    its actions' spans less the time they sat blocked in point-to-point receives. Executor
    overhead between actions counts as idle, as it would on the paper's timeline.
  - The simulator's prediction for the same schedule with the measured costs: the median
    compute time of each op (F, B, W, BW) on each stage, simulated with the one simulator
    that `mode=simulate` uses (schedules/simulate.py), so the two numbers differ only by
    what the model of the schedule leaves out (overheads, jitter, communication).
  - Under data parallel, the exposed reduce time of each rank (the executor's wait for its
    gradient reductions after its last action) beside the simulator's, whose communication
    lane takes each stage's reduction as bytes over `cluster.dp_bandwidth_gbs` (plan.reduce_ms),
    and the step time with it (`makespan_with_reduce`) measured and simulated.
  - The collectives inside each action (expert parallel's all-to-alls, context parallel's K/V
    traffic: runtime/collectives.py) in the timeline, beside their action, and the step's
    all-to-all time, total and exposed, as `moe/a2a_*`. A collective's exposed time stays inside
    its action's compute time (the bubble counts point-to-point waits only, as the simulator does).

Pure Python, no torch: rank 0 runs this on gathered `RankSample`s.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pipetrain.metrics import names
from pipetrain.metrics.records import ActionTiming, RankSample
from pipetrain.schedules.export import rounded
from pipetrain.schedules.ir import Op, Schedule, Step
from pipetrain.schedules.simulate import ReduceSpan, SimResult, StageCosts, TimedStep, simulate

OPS = ("F", "B", "W", "BW")


def parts_ms(step: Step, timing: ActionTiming) -> list[tuple[Op, int, float]]:
    """(op, stage, compute ms) of each part of a measured step (one part unless F&B)."""
    parts = step.parts()
    ms = timing.part_ms
    if len(ms) != len(parts):  # no per-part split recorded: share the step's time evenly
        ms = (timing.compute_ms / len(parts),) * len(parts)
    return [(a.op, a.stage, t) for a, t in zip(parts, ms)]


def stage_costs(schedule: Schedule, samples: Sequence[RankSample]) -> StageCosts:
    """Median measured F, B, W per stage. A stage that only ran full backwards (BW) gets
    b = median BW and w = 0, which the simulator adds back up for its BW actions; one that ran
    both (dualpipe, dualpipev) keeps its BW median apart (under recompute a BW recomputes once,
    B and W once each)."""
    times: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for s in samples:
        row = schedule.steps[s.rank]
        for t in s.timings:
            for op, stage, ms in parts_ms(row[t.index], t):
                times[(op, stage)].append(max(ms, 0.0))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = schedule.placement.num_stages
    f = tuple(med.get((Op.F, st), 0.0) for st in range(n))
    b, w = [], []
    for st in range(n):
        if (Op.B, st) in med:
            b.append(med[(Op.B, st)])
            w.append(med.get((Op.W, st), 0.0))
        else:
            b.append(med.get((Op.BW, st), 0.0))
            w.append(0.0)
    return StageCosts(f, tuple(b), tuple(w), tuple(med.get((Op.BW, st), b[st] + w[st]) for st in range(n)))


@dataclass(frozen=True)
class StepMeasurement:
    """One step on every rank: measured and simulated side by side (rank 0 builds it)."""

    step: int
    schedule: Schedule
    samples: tuple[RankSample, ...]  # by rank
    offsets_ms: tuple[float, ...]  # where each rank's step began on the common axis
    measured: SimResult  # the measured step as a SimResult: render.render_timeline draws it
    simulated: SimResult  # the simulator's run with `measured.costs` (the medians)
    # Under data / tensor / context parallel: the global rank of each measured pipeline rank (every
    # pipeline runs the same schedule; pipeline 0's is measured), and the highest memory peak of every
    # rank of the world (memory/peak_gb covers every replica). Empty / None: the pipeline is the world.
    ranks: tuple[int, ...] = ()
    world_peak_memory_bytes: Optional[int] = None

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each measured pipeline rank, in pipeline order (what "rank" means in
        every metric name, table, timeline and trace)."""
        return self.ranks or tuple(range(len(self.samples)))

    @property
    def is_world(self) -> bool:
        """Whether the measured pipeline is every rank (no data / tensor / context parallel)."""
        return not self.ranks or self.global_ranks == tuple(range(len(self.samples)))

    @property
    def makespan_ms(self) -> float:
        return self.measured.makespan

    @property
    def bubble_per_rank(self) -> tuple[float, ...]:
        return self.measured.bubble_fraction_per_rank

    @property
    def bubble_mean(self) -> float:
        return self.measured.bubble_fraction_mean

    def op_ms(self, rank: int) -> dict[str, float]:
        """Total compute ms of each op (F, B, W, BW) on a rank in this step."""
        out = dict.fromkeys(OPS, 0.0)
        row = self.schedule.steps[rank]
        for t in self.samples[rank].timings:
            for op, _, ms in parts_ms(row[t.index], t):
                out[op.value] += ms
        return out

    def wait_ms(self, rank: int) -> float:
        return sum(t.wait_ms for t in self.samples[rank].timings)

    def collective_ms(self, rank: int, group: str) -> tuple[float, float]:
        """(total, exposed) ms of a rank's collectives of `group` ("ep", "cp") in this step."""
        events = [c for t in self.samples[rank].timings for c in t.collectives if c.group == group]
        return sum(c.total_ms for c in events), sum(c.exposed_ms for c in events)

    @property
    def data_parallel(self) -> bool:
        """Whether the step reduced gradients over data parallel (the schedule has REDUCE_GRAD marks)."""
        return bool(self.schedule.reduces)

    @property
    def reduce_exposed_ms(self) -> tuple[float, ...]:
        """Per rank, the measured wait for its gradient reductions after its last action."""
        return tuple(s.reduce_exposed_ms for s in self.samples)

    def rank_rows(self) -> list[dict[str, Any]]:
        """Per rank: measured and simulated bubble, peak memory split, ms in each op and waiting."""
        rows = []
        for r, s in enumerate(self.samples):
            ops = self.op_ms(r)
            rows.append({
                "rank": self.global_ranks[r], "pp": r, "stages": list(self.schedule.placement.stages_of(r)),
                "bubble": self.bubble_per_rank[r], "simulated_bubble": self.simulated.bubble_fraction_per_rank[r],
                "peak_memory_bytes": s.peak_memory_bytes, "activation_bytes": s.peak_activation_bytes,
                "other_bytes": s.peak_memory_bytes - s.peak_activation_bytes,
                **({"reserved_bytes": s.cuda_reserved_bytes} if s.cuda_reserved_bytes is not None else {}),
                **{f"{op.lower()}_ms": ops[op] for op in OPS}, "wait_ms": self.wait_ms(r),
            })
            if self.data_parallel:
                rows[-1].update(reduce_exposed_ms=s.reduce_exposed_ms,
                                simulated_reduce_exposed_ms=self.simulated.reduce_exposed_ms[r])
        return rows

    def timeline_rows(self) -> list[dict[str, Any]]:
        """Every measured step on the common axis (ms from the earliest rank's start), each followed by
        the collectives inside it: op their group ("ep", "cp", "node"), step their label, wait_ms the
        time the rank sat blocked in them, compute_ms 0."""
        rows = []
        for r, s in enumerate(self.samples):
            steps, off, g = self.schedule.steps[r], self.offsets_ms[r], self.global_ranks[r]
            for t in s.timings:
                parts = steps[t.index].parts()
                where = {"stage": parts[0].stage, "microbatch": parts[0].microbatch}
                rows.append({
                    "rank": g, "step": t.step, "op": "F&B" if len(parts) > 1 else parts[0].op.value, **where,
                    "start_ms": rounded(off + t.start_ms), "end_ms": rounded(off + t.end_ms),
                    "compute_ms": rounded(t.compute_ms), "wait_ms": rounded(t.wait_ms),
                })
                rows += [{"rank": g, "step": c.label, "op": c.group, **where, "start_ms": rounded(off + c.start_ms),
                          "end_ms": rounded(off + c.end_ms), "compute_ms": 0.0, "wait_ms": rounded(c.exposed_ms)}
                         for c in t.collectives]
        return rows

    def record(self) -> dict[str, Any]:
        """The step's measured metrics under their public names (metrics/names.py), as
        metrics.jsonl, wandb and TensorBoard get them."""
        sim, costs, ranks = self.simulated, self.measured.costs, self.global_ranks
        peak = max(s.peak_memory_bytes for s in self.samples)
        out = {
            names.BUBBLE: rounded(self.bubble_mean),
            names.BUBBLE_SIM: rounded(sim.bubble_fraction_mean),
            names.MAKESPAN: rounded(self.makespan_ms),
            names.MAKESPAN_SIM: rounded(sim.makespan),
            names.PEAK_GB: names.gb(max(peak, self.world_peak_memory_bytes or 0)),  # every replica's
            **names.per_rank(names.BUBBLE, [rounded(x) for x in self.bubble_per_rank], ranks),
            **names.per_rank(names.BUBBLE_SIM, [rounded(x) for x in sim.bubble_fraction_per_rank], ranks),
            **names.per_rank(names.PEAK_GB, [names.gb(s.peak_memory_bytes) for s in self.samples], ranks),
            **names.per_rank(names.ACTIVATIONS_GB, [names.gb(s.peak_activation_bytes) for s in self.samples], ranks),
            **names.per_rank(names.ACTIVATION_SETS, [s.peak_activation_sets for s in self.samples], ranks),
            **names.per_rank(names.STATIC_GB, [names.gb(s.static_bytes) for s in self.samples], ranks),
            **names.per_stage({op: [rounded(x) for x in v] for op, v in (("f_ms", costs.f), ("b_ms", costs.b),
                                                                        ("w_ms", costs.w))}),
        }
        out.update(names.moe_metrics([s.moe for s in self.samples]))
        out.update(names.a2a_metrics([self.collective_ms(r, "ep") for r in range(len(self.samples))], ranks))
        out.update(names.cp_metrics([s.cp for s in self.samples], ranks))
        reserved = [s.cuda_reserved_bytes for s in self.samples]
        if all(b is not None for b in reserved):  # on GPU
            out.update({names.PEAK_RESERVED_GB: max(names.gb(b) for b in reserved),
                        **names.per_rank(names.PEAK_RESERVED_GB, [names.gb(b) for b in reserved], ranks)})
        if self.data_parallel:
            out.update(
                {names.MAKESPAN_REDUCE: rounded(self.measured.makespan_with_reduce),
                 names.MAKESPAN_REDUCE_SIM: rounded(sim.makespan_with_reduce)},
                **names.per_rank(names.REDUCE, [rounded(x) for x in self.reduce_exposed_ms], ranks),
                **names.per_rank(names.REDUCE_SIM, [rounded(x) for x in sim.reduce_exposed_ms], ranks),
            )
        return out


def measured_result(schedule: Schedule, samples: Sequence[RankSample], offsets: Sequence[float],
                    costs: StageCosts) -> SimResult:
    """The measured step in the simulator's shape. Each step is drawn where it computed:
    [end - compute, end], so time blocked in a receive shows as idle, as in the papers' figures.
    Each gradient reduction runs on the rank's lane from its issue to when it was seen done."""
    timeline, busy, ends, lanes = [], [], [], []
    for s, off in zip(samples, offsets):
        lanes.append(tuple(sorted((ReduceSpan(st, off + t, off + s.reduce_done_ms.get(st, s.step_ms))
                                   for st, t in s.reduce_issued_ms.items()), key=lambda sp: (sp.start, sp.stage))))
        row = schedule.steps[s.rank]
        timed = tuple(TimedStep(row[t.index], off + t.end_ms - max(t.compute_ms, 0.0), off + t.end_ms)
                      for t in s.timings)
        timeline.append(timed)
        busy.append(sum(max(t.compute_ms, 0.0) for t in s.timings))
        ends.append(off + max((t.end_ms for t in s.timings), default=0.0))
    makespan = max(ends, default=0.0)
    peaks = tuple(s.peak_activation_sets for s in samples)
    return SimResult(schedule, costs, 0.0, 0.0, makespan, tuple(timeline), tuple(busy), peaks,
                     reductions=tuple(lanes) if any(lanes) else ())


def start_offsets(samples: Sequence[RankSample]) -> tuple[float, ...]:
    """Where each rank's step began, in ms after the earliest rank's, from the shared end of the
    step's loss all-reduce. Without it (one process, no collective) every rank began at 0."""
    if any(s.sync_ms is None for s in samples):
        return (0.0,) * len(samples)
    last = max(s.sync_ms for s in samples)  # type: ignore[type-var]
    return tuple(last - s.sync_ms for s in samples)  # type: ignore[operator]


def measure_step(step: int, schedule: Schedule, samples: Sequence[RankSample], *,
                 comm_ms: float = 0.0, reduce_ms: Sequence[float] | None = None, ranks: Sequence[int] = (),
                 world_peak_memory_bytes: Optional[int] = None) -> StepMeasurement:
    """Combine every rank's sample of one step (one per pipeline rank, any order, `rank` its pipeline
    rank); `reduce_ms` (per stage, plan.reduce_ms) puts the simulated gradient reductions on the
    communication lanes; `ranks` and `world_peak_memory_bytes`: StepMeasurement's."""
    samples = tuple(sorted(samples, key=lambda s: s.rank))
    if [s.rank for s in samples] != list(range(schedule.num_ranks)):
        raise ValueError(f"need one sample per rank 0..{schedule.num_ranks - 1}, got ranks {[s.rank for s in samples]}")
    offsets = start_offsets(samples)
    costs = stage_costs(schedule, samples)
    measured = measured_result(schedule, samples, offsets, costs)
    simulated = simulate(schedule, costs, comm_ms=comm_ms, check=False, reduce_ms=reduce_ms)
    return StepMeasurement(step, schedule, samples, offsets, measured, simulated, tuple(ranks), world_peak_memory_bytes)
