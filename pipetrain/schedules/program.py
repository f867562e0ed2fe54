"""A rank's program: its action list as the executor runs it, worked out once before the first step.

Everything per action that does not change from step to step (the message an action receives and
the one it sends, its name in error messages, the point-to-point plans of training and of
evaluation, which microbatches' inputs and targets the rank reads, each held stage's neighbours)
is a pure function of the schedule and the rank (runtime/executor.py interprets it).

Imports no torch (a test enforces it for all of `schedules/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipetrain.schedules.ir import Action, Op, Schedule
from pipetrain.schedules.p2p import Message, RankTransfers, build_plan, crossings, forward_plan

# One atomic action as the interpreter runs it: (action, the message it receives from another
# rank, the one it sends to another rank (None: local or none), its name in error messages).
Part = tuple[Action, Optional[Message], Optional[Message], str]


@dataclass(frozen=True)
class RankProgram:
    plan: RankTransfers  # training's point-to-point plan (schedules/p2p.py)
    eval_plan: RankTransfers  # evaluate()'s: the forwards only
    steps: tuple[tuple[Part, ...], ...]  # per step of the rank's list, its parts (two for an F&B pair)
    eval_steps: tuple[Part, ...]  # the forward parts, in order
    texts: tuple[str, ...]  # each step's name ("2F0&1B3")
    inputs: frozenset[int]  # microbatches whose input the rank reads (its chains' first stages)
    targets: frozenset[int]  # and whose targets (its chains' last stages)
    prev: dict[int, Optional[int]]  # each held stage's neighbours in its chain (None: it starts / ends it)
    next: dict[int, Optional[int]]


def rank_program(schedule: Schedule, rank: int, *, lookahead: int = 1, where: str = "") -> RankProgram:
    """The program of `rank`; `where` follows every action's name in errors (" on rank 3 (pp 1, dp 0)")."""
    pl = schedule.placement
    plan = build_plan(schedule, rank, lookahead=lookahead)
    eval_plan = forward_plan(plan)
    sends = {a: out for a, _, out in crossings(schedule, rank)}
    waits = dict(zip(plan.parts, plan.waits))
    texts = tuple(str(step) for step in schedule.steps[rank])
    steps = tuple(tuple((a, waits[a], sends[a], text + where) for a in step.parts())
                  for step, text in zip(schedule.steps[rank], texts))
    eval_steps = tuple((a, need, sends[a], f"{a}{where}") for a, need in zip(eval_plan.parts, eval_plan.waits))
    fs = [a for a in schedule.actions(rank) if a.op is Op.F]
    held = pl.stages_of(rank)
    return RankProgram(plan, eval_plan, steps, eval_steps, texts,
                       frozenset(a.microbatch for a in fs if pl.prev_stage(a.stage) is None),
                       frozenset(a.microbatch for a in fs if pl.next_stage(a.stage) is None),
                       {s: pl.prev_stage(s) for s in held}, {s: pl.next_stage(s) for s in held})
