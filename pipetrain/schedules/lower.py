"""Lowering passes: what a run does to its schedule, as pure functions of the schedule.

`pair_fb` (F&B pairs) runs before `reduce.py: add_reduces`, which places the gradient reductions.
Compiling (trainer.compile) changes no action: a compiled stage keeps its B and W apart, its
matrix-weight modules running eager so that W holds their weight-gradient GEMMs
(parallel/parallelize.py apply_compile, runtime/backward.py); `split_on` says which stages that is.

Lowered once where the schedule is built (plan.py: build_schedule), so schedule.csv, the timeline,
the simulation, the REDUCE_GRAD places and the executor all read the schedule that runs.
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Collection

from pipetrain.schedules.deps import walk
from pipetrain.schedules.ir import Action, Op, Overlap, Schedule, Step


def split_on(schedule: Schedule, stages: Collection[int]) -> list[str]:
    """The B and W actions the schedule runs on `stages` (empty where they run BW only)."""
    stages = frozenset(stages)
    return [str(a) for r in range(schedule.num_ranks) for a in schedule.actions(r)
            if a.stage in stages and a.op in (Op.B, Op.W)]


def pair_fb(schedule: Schedule) -> Schedule:
    """Megatron's combined 1F1B as a pass: on each rank, a forward followed at once by a backward
    (B or BW) of another microbatch becomes an F&B pair (`Overlap`), so the executor may interleave
    the two (pipeline.fb_overlap) and hide one's all-to-alls behind the other's compute. Only where
    the dependencies allow: a pair starts when both parts' inputs exist and hands on both outputs
    when both end, so a backward whose input gradient comes (through other ranks) from the forward
    beside it cannot join it; each candidate is kept only if the schedule still runs to the end and
    no later (deps.walk at F = W = 1, B = BW = 2, a pair the sum of its parts: the overlap must not
    be needed to pay for the pair's later hand-off of its forward's output). The parts keep their
    order and count, so the point-to-point plan, hand-written communication and REDUCE_GRAD
    boundaries stay where they were; an existing pair (DualPipe's) is left as it is. Run serially, a
    pair does exactly what its two actions did."""
    rows = [list(row) for row in schedule.steps]
    marked = [_marker_boundaries(schedule, r) for r in range(schedule.num_ranks)]
    best = _unit_makespan(schedule)
    changed = False
    for r, row in enumerate(rows):
        i, parts = 0, 0  # parts: atomic actions before row[i]
        while i + 1 < len(row):
            f, b = row[i], row[i + 1]
            if (isinstance(f, Action) and isinstance(b, Action) and f.op is Op.F and b.op.is_backward
                    and b.microbatch != f.microbatch and parts + 1 not in marked[r]):
                row[i: i + 2] = [Overlap(f, b)]
                span = _unit_makespan(_with_rows(schedule, rows))
                if span <= best:
                    best, changed = span, True
                    i, parts = i + 1, parts + 2
                    continue
                row[i: i + 1] = [f, b]  # it would wait on itself: keep the two apart
            parts += len(row[i].parts())
            i += 1
    return _with_rows(schedule, rows) if changed else schedule


def _unit_cost(_: int, step: Step) -> float:
    return sum(1.0 if a.op in (Op.F, Op.W) else 2.0 for a in step.parts())


def _unit_makespan(schedule: Schedule) -> float:
    """The schedule's length at unit costs (`pair_fb`); infinite where it would wait on itself."""
    w = walk(schedule, _unit_cost)
    return max((row[-1] for row in w.end if row), default=0.0) if w.complete else float("inf")


def _marker_boundaries(schedule: Schedule, rank: int) -> set[int]:
    """Boundaries (atomic actions before) where the rank's list has a hand-written send/receive or a reduction."""
    marks = (schedule.comms[rank] if schedule.comms else ()) + (schedule.reduces[rank] if schedule.reduces else ())
    return {b for b, _ in marks}


def _with_rows(schedule: Schedule, rows: list[list[Step]]) -> Schedule:
    return dataclasses.replace(schedule, steps=tuple(tuple(row) for row in rows))
