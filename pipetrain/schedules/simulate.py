"""Event-driven simulator: makespan, bubble and live activations of a schedule.

Every step starts when its rank is free and its inputs exist (`deps.walk`), a
cross-rank input arriving `comm_ms` after it was produced. An `F&B` pair costs
(F + its backward) * (1 - fb_overlap), or, where the costs carry per-layer node times
(`StageCosts.layers`, one schedules/fb_pairs.py LayerNodes per layer: MoE stages under
pipeline.fb_overlap, issue #29), its serial time less what each paired layer (forward layer i
ascending with backward layer j descending, as runtime/overlap.py interleaves them) saves: for two
layers with all-to-alls, their serial time less `chain_ms`, the executor's node order on one thread
with the all-to-alls in flight beside it (fb_pairs.pair_saving; `StageCosts.one_link`: queued on one
link, as the analytic costs' bytes over cluster.ep_bandwidth_gbs are); any other pair, and the unpaired
layers, run serially. A BW backward spreads its W over its compute nodes (LayerNodes.backward).
An activation set (stage, microbatch) is live from the start of its F to the end of its W or BW;
at equal times frees come first.

Under data parallel (a schedule with `REDUCE_GRAD` marks, schedules/reduce.py) each rank also
has one serial communication lane: a stage's reduction starts when the step before its mark
has ended and the lane is free, and keeps the lane `reduce_ms[stage]` busy
(schedules/reduce_cost.py). The bubble stays a compute measure (busy / makespan); what the
lane adds is the exposed reduce time of each rank (its lane's end past its last compute) and
the step time with it, `makespan_with_reduce`. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Collection, Iterator, NamedTuple, Optional, Sequence

from pipetrain.schedules.deps import walk
from pipetrain.schedules.fb_pairs import LayerNodes, pair_saving
from pipetrain.schedules.gc_pause import without_gc
from pipetrain.schedules.ir import Action, Op, Overlap, Schedule, Step
from pipetrain.schedules.validate import validate


@dataclass(frozen=True)
class StageCosts:
    """Per-stage-id time (ms) of one microbatch's F, B (input grad) and W (weight grad)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    # a fused BW per stage where it is not b + w (a recomputing stage that also runs W apart pays
    # the recompute once in a BW, in both its B and its W); empty: b + w
    bw: tuple[float, ...] = ()
    # per stage id, per layer in forward order, its node times (fb_pairs.LayerNodes) for the F&B
    # overlap model (`hidden`); empty: F&B pairs use the scalar fb_overlap
    layers: tuple[tuple[LayerNodes, ...], ...] = ()
    # the layers' all-to-alls share one link (fb_pairs.chain_ms one_link: times from bytes over a bandwidth,
    # the analytic path); False: each runs from its issue beside any other (measured times, a latency)
    one_link: bool = False
    # (forward stage, backward stage, BW?) -> what the pair saves: the chain is priced once per pair of stages
    _saved: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not len(self.f) == len(self.b) == len(self.w) or self.bw and len(self.bw) != len(self.f) \
                or self.layers and len(self.layers) != len(self.f):
            raise ValueError("StageCosts needs one f, b and w (and bw and layers, where given) per stage")
        if min(self.f + self.b + self.w + self.bw, default=0.0) < 0:
            raise ValueError("stage costs must be >= 0 ms")
        if not all(isinstance(l, LayerNodes) for stage in self.layers for l in stage):
            raise TypeError("StageCosts.layers holds one schedules/fb_pairs.py LayerNodes per layer")

    def fused(self, s: int) -> float:
        """One microbatch's BW on stage `s`."""
        return self.bw[s] if self.bw else self.b[s] + self.w[s]

    @classmethod
    def uniform(cls, num_stages: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> "StageCosts":
        return cls((f,) * num_stages, (b,) * num_stages, (w,) * num_stages)

    @classmethod
    def from_chunks(cls, schedule: Schedule, chunks: Sequence[tuple[float, float, float]]) -> "StageCosts":
        """Costs per model chunk (f, b, w) -> per stage id, via the placement (mirror stages share chunks)."""
        pl = schedule.placement
        if len(chunks) != pl.num_chunks:
            raise ValueError(f"expected costs for {pl.num_chunks} model chunks, got {len(chunks)}")
        per_stage = [chunks[pl.chunk_of(s)] for s in range(pl.num_stages)]
        return cls(*(tuple(c[i] for c in per_stage) for i in range(3)))

    def with_recompute(self, split: Optional[Collection[int]] = None,
                       stages: Optional[Collection[int]] = None) -> "StageCosts":
        """The costs under activation recompute (trainer.activation_checkpointing) on `stages` (None:
        every stage): a stage's backward runs its forward again, so B pays f, and on the stages in
        `split` (those running W apart from B; None: every stage) W pays f once more, since
        non-reentrant checkpointing recomputes for the second backward pass too (sleep model, zbh1:
        B and W each 20 -> 42 ms with f 21 ms). A fused BW is one pass: it pays f once."""
        n = len(self.f)
        on = range(n) if stages is None else stages
        again = range(n) if split is None else split
        extra = [self.f[s] if s in on else 0.0 for s in range(n)]
        return dataclasses.replace(
            self, b=tuple(b + x for b, x in zip(self.b, extra)),
            w=tuple(w + (x if s in again else 0.0) for s, (w, x) in enumerate(zip(self.w, extra))),
            bw=tuple(self.fused(s) + extra[s] for s in range(n)))

    def with_selective(self, again: Sequence[float], stages: Collection[int]) -> "StageCosts":
        """The costs under selective recompute (trainer.recompute=selective) on `stages`: a stage's B (and a BW)
        runs its recomputed modules' forward again (`again`, per stage id); W recomputes nothing."""
        extra = [again[s] if s in stages else 0.0 for s in range(len(self.f))]
        return dataclasses.replace(self, b=tuple(b + x for b, x in zip(self.b, extra)),
                                   bw=tuple(self.fused(s) + x for s, x in enumerate(extra)))

    def action(self, a: Action) -> float:
        s = a.stage
        return {Op.F: self.f[s], Op.B: self.b[s], Op.W: self.w[s], Op.BW: self.fused(s)}[a.op]

    def step(self, step: Step, fb_overlap: float = 0.0) -> float:
        if isinstance(step, Overlap):
            serial = self.action(step.forward) + self.action(step.backward)
            if self.layers:
                return serial - self.hidden(step.forward, step.backward)
            return serial * (1.0 - fb_overlap)
        return self.action(step)

    def hidden(self, forward: Action, backward: Action) -> float:
        """What an F&B pair saves over running its halves serially: per paired layer (forward i
        ascending, backward j descending, as the executor interleaves them) fb_pairs.pair_saving, a BW
        with its W in its nodes. Recompute and per-action overheads stay serial."""
        key = (forward.stage, backward.stage, backward.op is Op.BW)
        if key not in self._saved:
            fwd, bwd = self.layers[forward.stage], self.layers[backward.stage][::-1]
            self._saved[key] = sum(pair_saving(f, b, with_w=key[2], one_link=self.one_link) for f, b in zip(fwd, bwd))
        return self._saved[key]


def split_stages(schedule: Schedule) -> set[int]:
    """Stages on which the schedule runs a W action (B and W apart)."""
    return {a.stage for row in schedule.steps for step in row for a in step.parts() if a.op is Op.W}


class TimedStep(NamedTuple):
    """A step with its simulated start and end (ms). A tuple: a frozen dataclass's __init__ cost
    a tenth of simulating P=10^4, M=64 (1.3M of them)."""

    step: Step
    start: float
    end: float


@dataclass(frozen=True)
class ReduceSpan:
    """One stage's gradient reduction on a rank's communication lane (ms)."""

    stage: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    costs: StageCosts
    comm_ms: float
    fb_overlap: float
    makespan: float
    timeline: tuple[tuple[TimedStep, ...], ...]  # per rank, in execution order
    busy_per_rank: tuple[float, ...]
    peak_activations_per_rank: tuple[int, ...]
    extra: dict = field(default_factory=dict)
    reductions: tuple[tuple[ReduceSpan, ...], ...] = ()  # per rank, in lane order; () without data parallel

    @property
    def compute_end_per_rank(self) -> tuple[float, ...]:
        return tuple(row[-1].end if row else 0.0 for row in self.timeline)

    @property
    def reduce_exposed_ms(self) -> tuple[float, ...]:
        """Per rank, how long its lane runs past its last compute: the reduce time the step waits for."""
        if not self.reductions:
            return tuple(0.0 for _ in self.timeline)
        return tuple(max(0.0, max((sp.end for sp in lane), default=0.0) - end)
                     for lane, end in zip(self.reductions, self.compute_end_per_rank))

    @property
    def makespan_with_reduce(self) -> float:
        """The step time when it ends with every reduction done (= makespan without data parallel)."""
        return max([self.makespan, *(sp.end for lane in self.reductions for sp in lane)])

    @property
    def idle_per_rank(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy_per_rank)

    @property
    def bubble_fraction_per_rank(self) -> tuple[float, ...]:
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy_per_rank)
        return tuple(1.0 - b / self.makespan for b in self.busy_per_rank)

    @property
    def bubble_fraction_mean(self) -> float:
        fr = self.bubble_fraction_per_rank
        return sum(fr) / len(fr)


def live_activations(timeline: Sequence[TimedStep]) -> Iterator[tuple[float, int]]:
    """(time, live activation sets after that time) at every time the count may change.

    A set is live from the start of its F to the end of its W or BW; frees come first at
    equal times (a (time, -1) event sorts before (time, +1)).
    """
    events: list[tuple[float, int]] = []
    for ts in timeline:
        for a in ts.step.parts():
            if a.op is Op.F:
                events.append((ts.start, +1))
            elif a.op in (Op.W, Op.BW):
                events.append((ts.end, -1))
    events.sort()
    live = 0
    for i, (t, delta) in enumerate(events):
        live += delta
        if i + 1 == len(events) or events[i + 1][0] != t:
            yield t, live


def peak_live_activations(timeline: Sequence[TimedStep]) -> int:
    """Most activation sets alive at once on one rank."""
    return max((live for _, live in live_activations(timeline)), default=0)


def reduce_lanes(schedule: Schedule, timeline: Sequence[Sequence[TimedStep]],
                 reduce_ms: Sequence[float]) -> tuple[tuple[ReduceSpan, ...], ...]:
    """Per rank, its reductions on one serial lane: each starts at max(end of the step holding
    the action before its mark, lane free) and takes `reduce_ms[stage]`."""
    if len(reduce_ms) != schedule.placement.num_stages:
        raise ValueError(
            f"reduce_ms covers {len(reduce_ms)} stages but the schedule has {schedule.placement.num_stages}")
    if min(reduce_ms, default=0.0) < 0:
        raise ValueError("reduce times must be >= 0 ms")
    lanes = []
    for r, row in enumerate(timeline):
        ends = [ts.end for ts in row for _ in ts.step.parts()]  # atomic action k -> end of its step
        free, spans = 0.0, []
        for boundary, red in sorted(schedule.reduces[r] if schedule.reduces else (), key=lambda t: t[0]):
            start = max(ends[boundary - 1] if boundary > 0 else 0.0, free)
            free = start + reduce_ms[red.stage]
            spans.append(ReduceSpan(red.stage, start, free))
        lanes.append(tuple(spans))
    return tuple(lanes)


@without_gc
def simulate(
    schedule: Schedule,
    costs: StageCosts | None = None,
    *,
    comm_ms: float = 0.0,
    fb_overlap: float = 0.0,
    check: bool = True,
    reduce_ms: Sequence[float] | None = None,
) -> SimResult:
    """Validate (unless check=False), then time the schedule under `costs` (default: 1 ms each op).
    `reduce_ms` (per stage) puts the schedule's REDUCE_GRAD marks on each rank's communication lane."""
    if not 0.0 <= fb_overlap < 1.0:
        raise ValueError(f"sim.fb_overlap must be in [0, 1), got {fb_overlap}")
    if comm_ms < 0:
        raise ValueError(f"sim.comm_ms must be >= 0, got {comm_ms}")
    if check:
        validate(schedule)
    pl = schedule.placement
    costs = costs or StageCosts.uniform(pl.num_stages)
    if len(costs.f) != pl.num_stages:
        raise ValueError(f"costs cover {len(costs.f)} stages but the schedule has {pl.num_stages}")
    w = walk(schedule, lambda r, step: costs.step(step, fb_overlap), comm_ms=comm_ms)
    assert w.complete, "validated schedule must not deadlock"
    timeline = tuple(
        tuple(TimedStep(step, s, e) for step, s, e in zip(row, w.start[r], w.end[r]))
        for r, row in enumerate(schedule.steps)
    )
    makespan = max((row[-1].end for row in timeline if row), default=0.0)
    busy = tuple(sum(ts.end - ts.start for ts in row) for row in timeline)
    peaks = tuple(peak_live_activations(row) for row in timeline)
    lanes = reduce_lanes(schedule, timeline, reduce_ms) if reduce_ms is not None and schedule.reduces else ()
    return SimResult(schedule, costs, comm_ms, fb_overlap, makespan, timeline, busy, peaks, reductions=lanes)
