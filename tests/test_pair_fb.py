"""schedules/lower.py pair_fb: Megatron's combined 1F1B as a pure pass. An F followed at once by a
backward of another microbatch becomes an F&B pair where the dependencies allow and the schedule gets
no longer for it, every part keeps its place (run serially, a pair does what its two actions did), and
DualPipe's own pairs stay."""

from __future__ import annotations

import pytest

from pipetrain.schedules import registry
from pipetrain.schedules.deps import walk
from pipetrain.schedules.ir import Action, Op, Overlap, Schedule, parse_comm
from pipetrain.schedules.lower import _unit_makespan, pair_fb
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.reduce import add_reduces
from pipetrain.schedules.validate import validate

pytestmark = pytest.mark.pure


def pairs(schedule: Schedule, rank: int) -> list[str]:
    return [str(s) for s in schedule.steps[rank] if isinstance(s, Overlap)]


def test_interleaved_1f1b_pairs_its_steady_state_and_plain_1f1b_stays_apart():
    s = registry.build("interleaved_1f1b", 2, 4, 2)
    p = pair_fb(s)
    validate(p)
    # each rank's forwards of one model chunk beside backwards of the other, where both inputs are there
    assert pairs(p, 0) == ["0F2&2BW0", "0F3&2BW1", "2F2&0BW0", "2F3&0BW1"]
    assert pairs(p, 1) == ["1F2&1BW0", "1F3&1BW1"]
    for r in range(2):
        assert list(p.actions(r)) == list(s.actions(r))  # same parts in the same order
    assert _unit_makespan(p) == _unit_makespan(s) == 27.0
    # Plain 1F1B: pairing its steady state (0F(m+1)&0BW(m) at P=2) holds each forward's output until the
    # pair ends, and the next rank waits for it: 48 unit times instead of 27 (41 even with a third of
    # every pair hidden), so the pass leaves it alone.
    one = registry.build("1f1b", 2, 8, 1)
    assert pair_fb(one) == one and _unit_makespan(one) == 27.0


@pytest.mark.parametrize("name, v", [("interleaved_1f1b", 2), ("zbh1", 1), ("zbv", 2), ("dualpipev", 2), ("gpipe", 1)])
def test_every_schedule_stays_valid_and_keeps_its_parts(name, v):
    s = registry.build(name, 4, 16, v)
    p = pair_fb(s)
    validate(p)
    assert pair_fb(p) == p  # paired once is paired
    assert _unit_makespan(p) <= _unit_makespan(s)
    for r in range(4):
        assert list(p.actions(r)) == list(s.actions(r))
        assert set(pairs(s, r)) <= set(pairs(p, r))  # DualPipe's own pairs are kept


def test_a_backward_that_waits_on_the_forward_beside_it_stays_apart():
    # Rank 1 runs both forwards before its first backward, so 0BW0's gradient needs 1F1, which
    # needs 0F1: pairing 0F1&0BW0 would wait on itself. Rank 1's 1F1 1BW0 pairs (1BW0 needs 1F0 only).
    pl = Placement.loop(2)
    F, BW = (lambda s, m: Action(Op.F, s, m)), (lambda s, m: Action(Op.BW, s, m))
    s = Schedule.build("hand", pl, 2, [[F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)],
                                       [F(1, 0), F(1, 1), BW(1, 0), BW(1, 1)]])
    forced = Schedule.build("hand", pl, 2, [[F(0, 0), Overlap(F(0, 1), BW(0, 0)), BW(0, 1)], list(s.steps[1])])
    assert not walk(forced, lambda _r, _s: 1.0).complete  # what the pass must avoid
    p = pair_fb(s)
    validate(p)
    assert pairs(p, 0) == [] and pairs(p, 1) == ["1F1&1BW0"]


def test_a_hand_written_send_or_a_reduction_between_the_two_keeps_them_apart():
    s = registry.build("interleaved_1f1b", 2, 4, 2)
    row = s.cells(0)
    k = next(i for i in range(len(row) - 1) if str(row[i]) == "0F2" and str(row[i + 1]) == "2BW0")
    marked = Schedule.build(s.name, s.placement, 4, [row[:k + 1] + [parse_comm("0SEND_F2")] + row[k + 1:],
                                                     s.cells(1)])
    assert "0F2&2BW0" in pairs(pair_fb(s), 0) and "0F2&2BW0" not in pairs(pair_fb(marked), 0)
    reduced = add_reduces(pair_fb(s))  # reductions placed after pairing land where they did without it
    assert reduced.reduces == add_reduces(s).reduces
