"""Lowering passes: what a run does to its schedule, as pure functions of the schedule.

`fuse_backward` is the first (`reduce.py: add_reduces`, which places the gradient reductions, runs
after it): a compiled stage (trainer.compile) cannot split its backward, so each of its B becomes
BW and its W goes. torch.distributed.pipelining's `_merge_bw` merges an adjacent I and W the same
way; here they need not be adjacent, since a compiled stage cannot run them apart at all. Why it
cannot: torch.compile turns each layer's backward into one node that computes the input and the
weight gradients together, and re-entering that node for W from the gradients B recorded gave
wrong weight gradients (torch 2.13), so B would have to do W's work and leave W nothing.

Lowered once where the schedule is built (plan.py: build_schedule), so schedule.csv, the timeline,
the simulation, the REDUCE_GRAD places and the executor all read the schedule that runs.
Pure Python, no torch.
"""

from __future__ import annotations

from typing import Collection

from pipetrain.schedules.ir import Action, Marker, Op, Overlap, Schedule, Step


def fuse_backward(schedule: Schedule, stages: Collection[int]) -> Schedule:
    """The schedule with every B of a stage in `stages` turned into BW (an F&B pair `F&B` into `F&BW`)
    and that stage's W actions dropped. Other stages' actions, hand-written SEND/RECV cells and
    REDUCE_GRAD marks keep their places in each rank's list. No stage given: the schedule itself."""
    stages = frozenset(stages)
    if not stages or not any(a.stage in stages and a.op in (Op.B, Op.W)
                             for r in range(schedule.num_ranks) for a in schedule.actions(r)):
        return schedule
    rows: list[list[Step | Marker]] = []
    for r in range(schedule.num_ranks):
        row: list[Step | Marker] = []
        for cell in schedule.cells(r):
            if isinstance(cell, Action) and cell.op is Op.W and cell.stage in stages:
                continue  # its weight gradients were computed by the BW
            row.append(_fused(cell, stages))
        rows.append(row)
    return Schedule.build(schedule.name, schedule.placement, schedule.num_microbatches, rows)


def _fused(cell: Step | Marker, stages: frozenset[int]) -> Step | Marker:
    if isinstance(cell, Overlap):
        return Overlap(cell.forward, _fused(cell.backward, stages))  # type: ignore[arg-type]
    if isinstance(cell, Action) and cell.op is Op.B and cell.stage in stages:
        return Action(Op.BW, cell.stage, cell.microbatch)
    return cell


def split_on(schedule: Schedule, stages: Collection[int]) -> list[str]:
    """The B and W actions the schedule still runs on `stages` (empty once `fuse_backward` lowered it)."""
    stages = frozenset(stages)
    return [str(a) for r in range(schedule.num_ranks) for a in schedule.actions(r)
            if a.stage in stages and a.op in (Op.B, Op.W)]
