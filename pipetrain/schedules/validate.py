"""Validator: a schedule is complete, well placed, and free of deadlock.

Complete: every (stage, microbatch) on the microbatch's chain gets exactly one F
and either one BW or one B and one W. Well placed: an action runs on the rank
that holds its stage, on a stage of its microbatch's chain. Deadlock-free: the
dependency walk (`deps.walk`, blocking receives) runs every step; a B before its
W and each input before its consumer are part of that.

Reduced once: a schedule carrying gradient reductions (data parallel) has one per stage
per holding rank, after that stage's last weight gradient (schedules/reduce.py).

NCCL-safe: the point-to-point plan (schedules/p2p.py) issues, per pair of ranks, its
messages in one order on both sides and never waits on an operation issued after it,
under the stream rule of the configured transport (pipeline.p2p_transport: a stream per
pair of ranks, or one per rank for a single process group).

Failures raise `ScheduleError` (a ValueError) whose message ends with the
rank x step grid, the failing slot marked `>...<`.
"""

from __future__ import annotations

from pipetrain.schedules.deps import Key, Walk, walk
from pipetrain.schedules.gc_pause import without_gc
from pipetrain.schedules.ir import Op, Schedule
from pipetrain.schedules.p2p import TRANSPORT_STREAMS, PlanError
from pipetrain.schedules.p2p_check import check_plan
from pipetrain.schedules.reduce import ReduceError, check_reduces


class ScheduleError(ValueError):
    """A schedule is incomplete, misplaced or deadlocks; the message shows where."""


def format_grid(
    schedule: Schedule,
    marks: dict[tuple[int, int], str] | None = None,
    *,
    window: int = 10,
) -> str:
    """Rank x step grid. Marked slots print as `>0F3<`; around marks only `window` steps either side show."""
    marks = marks or {}
    longest = max([len(r) for r in schedule.steps] + [c + 1 for (_, c) in marks])
    lo, hi = 0, longest
    if marks and longest > 2 * window + 1:
        cols = [c for (_, c) in marks]
        lo, hi = max(0, min(cols) - window), min(longest, max(cols) + window + 1)
    cells = {
        (r, c): (f">{s}<" if (r, c) in marks else str(s))
        for r, row in enumerate(schedule.steps)
        for c, s in enumerate(row)
        if lo <= c < hi
    }
    for (r, c) in marks:
        cells.setdefault((r, c), ">(none)<")
    width = max((len(v) for v in cells.values()), default=3)
    header = "step    " + " ".join(f"{c:>{width}}" for c in range(lo, hi))
    lines = [header]
    for r in range(schedule.num_ranks):
        row = " ".join(f"{cells.get((r, c), '.'):>{width}}" for c in range(lo, hi))
        lines.append(f"rank {r:<3}" + row)
    if lo > 0 or hi < longest:
        lines.append(f"(steps {lo}..{hi - 1} of {longest} shown)")
    notes = [f"  rank {r} step {c}: {why}" for (r, c), why in sorted(marks.items())]
    return "\n".join(lines + notes)


def _fail(schedule: Schedule, headline: str, marks: dict[tuple[int, int], str]) -> None:
    raise ScheduleError(f"schedule {schedule.name!r}: {headline}\n{format_grid(schedule, marks)}")


def check_placement(schedule: Schedule) -> None:
    """Every action is on the rank holding its stage, on its microbatch's chain, with a valid id."""
    pl, M = schedule.placement, schedule.num_microbatches
    for r, row in enumerate(schedule.steps):
        for c, step in enumerate(row):
            for a in step.parts():
                why = None
                if not 0 <= a.stage < pl.num_stages:
                    why = f"stage {a.stage} does not exist (stages 0..{pl.num_stages - 1})"
                elif not 0 <= a.microbatch < M:
                    why = f"microbatch {a.microbatch} does not exist (microbatches 0..{M - 1})"
                elif pl.rank_of(a.stage) != r:
                    why = f"{a} is on rank {r} but stage {a.stage} lives on rank {pl.rank_of(a.stage)}"
                elif pl.chain_of_stage(a.stage) != pl.chain_of(a.microbatch, M):
                    why = (
                        f"microbatch {a.microbatch} flows through chain {pl.chain_of(a.microbatch, M)} "
                        f"{list(pl.chains[pl.chain_of(a.microbatch, M)])}, not stage {a.stage}"
                    )
                if why:
                    _fail(schedule, why, {(r, c): why})


def check_complete(schedule: Schedule) -> None:
    """Exactly one F, and one BW or one B + one W, per (stage, microbatch) of each chain."""
    pl, M = schedule.placement, schedule.num_microbatches
    # A plain dict, not a Counter: a Counter's missing keys cost a Python call each (10^6 at P=10^4).
    where: dict[tuple[Op, int, int], tuple[int, int]] = {}  # action -> (rank, step): seen once
    for r, row in enumerate(schedule.steps):
        for c, step in enumerate(row):
            for a in step.parts():
                key = (a.op, a.stage, a.microbatch)
                if key in where:
                    why = f"{a} appears twice (first at rank {where[key][0]} step {where[key][1]})"
                    _fail(schedule, why, {(r, c): why, where[key]: "first occurrence"})
                where[key] = (r, c)
    for m in range(M):
        for s in pl.chains[pl.chain_of(m, M)]:
            f, b, w, bw = ((op, s, m) in where for op in (Op.F, Op.B, Op.W, Op.BW))
            problem = None
            if not f:
                problem = f"{s}F{m} is missing"
            elif bw and (b or w):
                problem = f"stage {s} microbatch {m} has a BW and also a split B/W"
            elif not bw and not b:
                problem = f"{s}B{m} or {s}BW{m} is missing"
            elif b and not w:
                problem = f"{s}W{m} is missing (every B needs its W)"
            elif w and not b:
                problem = f"{s}W{m} has no {s}B{m}"
            if problem:
                rank = pl.rank_of(s)
                _fail(schedule, problem, {(rank, len(schedule.steps[rank])): problem})


def _describe_key(key: Key) -> str:
    kind, s, m = key
    return {"F": f"{s}F{m}", "grad": f"{s}B{m} (or {s}BW{m})", "weights": f"{s}W{m}"}[kind]


def check_deadlock_free(schedule: Schedule) -> Walk:
    """Run the dependency walk with unit costs; report every rank that cannot proceed."""
    result = walk(schedule, lambda r, s: 1.0)
    if result.complete:
        return result
    marks = {}
    for st in result.stuck:
        waits = ", ".join(_describe_key(k) for k in st.waiting_for)
        marks[(st.rank, st.index)] = f"waits for {waits}, which never happens before it"
    _fail(schedule, f"deadlock: {len(result.stuck)} rank(s) blocked", marks)


def check_p2p(schedule: Schedule, *, lookahead: int = 1, unit_walk: Walk | None = None,
              transport: str = "pair_groups") -> None:
    """The point-to-point plan obeys NCCL's in-order rule under the transport's stream rule
    (schedules/p2p_check.py: check_plan), on any machine: a plan that would hang on GPUs is
    refused on a laptop too. One line, naming the ranks, the messages and the knob to change."""
    if transport not in TRANSPORT_STREAMS:
        raise ValueError(f"pipeline.p2p_transport must be one of {', '.join(TRANSPORT_STREAMS)} (got {transport!r})")
    streams = TRANSPORT_STREAMS[transport]
    try:
        check_plan(schedule, lookahead=lookahead, unit_walk=unit_walk, streams=streams)
    except PlanError as e:
        raise ScheduleError(
            f"schedule {schedule.name!r}: {e}{_p2p_fix(schedule, lookahead, unit_walk, streams)}") from None


def hangs_on_nccl(schedule: Schedule, *, lookahead: int, transport: str) -> bool:
    """Whether `schedule`'s P2P plan would hang or mismatch on NCCL under `transport` (the planner's test)."""
    try:
        check_p2p(schedule, lookahead=lookahead, transport=transport)
    except ScheduleError:
        return True
    return False


def _p2p_fix(schedule: Schedule, lookahead: int, unit_walk: Walk | None, streams: str) -> str:
    """The knobs that make a plan refused under one stream per rank pass (tried only on failure)."""
    if streams == "pair":
        return ""
    fixes = []
    for knob, kw in (("pipeline.p2p_transport=pair_groups", {"streams": "pair"}),
                     ("pipeline.p2p_lookahead=0", {"streams": "rank", "lookahead": 0})):
        if knob.endswith("=0") and lookahead == 0:
            continue
        try:
            check_plan(schedule, **{"lookahead": lookahead, "unit_walk": unit_walk, "run": True, **kw})
            fixes.append(knob)
        except PlanError:
            pass
    return f": set {' or '.join(fixes)}" if fixes else ""


@without_gc
def validate(schedule: Schedule, *, p2p_lookahead: int = 1, p2p_transport: str = "pair_groups") -> None:
    """Raise ScheduleError if the schedule is misplaced, incomplete, deadlocks, or its
    point-to-point plan would deadlock or mismatch messages on NCCL with `p2p_transport`
    (pipeline.p2p_transport: pair_groups, a stream per pair; one_group, a stream per rank)."""
    check_placement(schedule)
    check_complete(schedule)
    unit_walk = check_deadlock_free(schedule)
    check_p2p(schedule, lookahead=p2p_lookahead, unit_walk=unit_walk, transport=p2p_transport)
    try:
        check_reduces(schedule)
    except ReduceError as e:
        raise ScheduleError(f"schedule {schedule.name!r}: {e}") from None
