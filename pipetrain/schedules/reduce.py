"""Where each rank reduces a stage's gradients over its data-parallel group (pure data).

Under data parallel every stage's weight gradients must be reduced over the ranks that hold
the same stage in the other pipelines, once per optimizer step. The earliest correct moment
is right after the stage's last weight-gradient action on its rank (its last W, its last BW,
or the backward half of its last F&B pair): issued there, the reduction runs on its own
stream / thread while the rank drains the rest of its list (torch.distributed.pipelining's
`_add_reduce_grad` places its REDUCE_GRAD the same way). Megatron and DDP bucket the same
idea by parameter; here the unit is the stage, which is what the schedule knows.

Megatron's `--overlap-grad-reduce` off is the other choice (`at_end=True`, from
`parallel.overlap_reduce=false`): every stage's reduction after the rank's last action, so
none overlaps compute.

`add_reduces` places them; `check_reduces` checks a schedule that carries some (derived or
hand-written `{stage}REDUCE_GRAD` cells): one per stage per holding rank, after the stage's
last weight gradient. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses

from pipetrain.schedules.ir import Op, Reduce, Schedule


class ReduceError(ValueError):
    """A schedule's gradient reductions are missing, doubled, misplaced or too early."""


def last_weight_grad(schedule: Schedule, rank: int) -> dict[int, int]:
    """Stage -> the boundary right after its last weight-gradient action on `rank` (the number
    of atomic actions up to and including it)."""
    out: dict[int, int] = {}
    for i, a in enumerate(schedule.actions(rank)):
        if a.op in (Op.W, Op.BW):
            out[a.stage] = i + 1
    return out


def add_reduces(schedule: Schedule, *, at_end: bool = False) -> Schedule:
    """The schedule with one `{stage}REDUCE_GRAD` per local stage, right after the stage's last
    weight gradient (at one boundary, in stage order), or with `at_end` all of them after the
    rank's last action. Idempotent: a schedule that already has reductions (hand-written ones
    included) is checked and returned as is."""
    if schedule.reduces:
        check_reduces(schedule)
        return schedule
    rows = []
    for r in range(schedule.num_ranks):
        places = last_weight_grad(schedule, r)
        if at_end:
            end = sum(1 for _ in schedule.actions(r))
            places = dict.fromkeys(places, end)
        rows.append(tuple(sorted(((b, Reduce(s)) for s, b in places.items()), key=lambda t: (t[0], t[1].stage))))
    return dataclasses.replace(schedule, reduces=tuple(rows))


def check_reduces(schedule: Schedule) -> None:
    """Raise ReduceError unless every rank reduces each of its stages exactly once, after that
    stage's last weight gradient (at the latest after the rank's last action). A schedule without
    reductions passes (no data parallel)."""
    if not schedule.reduces:
        return
    pl = schedule.placement
    for r in range(schedule.num_ranks):
        places = last_weight_grad(schedule, r)
        end = sum(1 for _ in schedule.actions(r))
        seen: dict[int, int] = {}
        for boundary, red in schedule.reduces[r]:
            s = red.stage
            if boundary > end:
                raise ReduceError(f"rank {r} has {red} after {boundary} actions but runs only {end}: "
                                  f"move it to at most {end}")
            if s not in places:
                held = ", ".join(str(x) for x in pl.stages_of(r))
                raise ReduceError(
                    f"rank {r} has {red} but holds stages {held}: move it to rank "
                    f"{pl.rank_of(s) if 0 <= s < pl.num_stages else '?'} or delete it"
                )
            if s in seen:
                raise ReduceError(f"rank {r} reduces stage {s} twice ({red}): keep one per stage per step")
            if boundary < places[s]:
                raise ReduceError(
                    f"rank {r} has {red} after {boundary} actions, before stage {s}'s last weight gradient "
                    f"(action {places[s]}): move it after that action"
                )
            seen[s] = boundary
        missing = sorted(set(places) - set(seen))
        if missing:
            raise ReduceError(
                f"rank {r} never reduces stage {missing[0]}: add {missing[0]}REDUCE_GRAD after its last W/BW, "
                f"or leave every REDUCE_GRAD out of the file (pipetrain then places them)"
            )
