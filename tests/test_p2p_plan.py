"""Tier 1 (pure): the point-to-point plan of every schedule obeys NCCL's in-order rule.

NCCL runs the operations between two ranks in order on one stream and matches messages by
position. `check_plan` proves, before any process starts, that per direction both sides
agree on the order, that per pair both ranks issue their messages in one order, and that
running every rank's plan under those rules completes. Receive buffers stay bounded by the
lookahead, not by the number of microbatches. Hand-written plans (torch's SEND_F/RECV_F/
SEND_B/RECV_B cells) that break the rule are refused in one line naming two ranks and two
messages.
"""

from __future__ import annotations

import pytest

from pipetrain.schedules import registry
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.p2p import (
    Kind, Message, build_plans, forward_plan, needed_by, sent_by,
)
from pipetrain.schedules.p2p_check import check_plan
from pipetrain.schedules.validate import ScheduleError, validate

pytestmark = pytest.mark.pure

V = {"interleaved_1f1b": 2, "looped_bfs": 2}


def cases():
    for name in registry.names():
        spr = registry.get(name).fixed_stages_per_rank or V.get(name, 1)
        for P in (2, 4, 8):
            for M in sorted({P, 2 * P, 3 * P, 4 * P, 2 * P + 2}):
                if registry.get(name).is_valid(P, M, spr):
                    yield name, P, M, spr


@pytest.mark.parametrize("name,P,M,spr", list(cases()))
def test_every_schedule_passes_the_nccl_order_check(name, P, M, spr):
    sched = registry.build(name, P, M, spr)
    for lookahead in (0, 1, 2):
        check_plan(sched, lookahead=lookahead, run=True)
        plans = build_plans(sched, lookahead=lookahead)
        # every cross-rank message is sent once and received once, by the ranks the placement says
        sent, got = [], []
        for plan in plans:
            for groups in plan.issue:
                for g in groups:
                    sent += [(m, plan.rank, g.peer) for m in g.sends]
                    got += [(m, g.peer, plan.rank) for m in g.recvs]
        expected = [(m, r, m.dst) for r in range(P) for a in sched.actions(r) if (m := sent_by(a, sched, r))]
        assert sorted(sent, key=str) == sorted(expected, key=str) == sorted(got, key=str)
        # receive buffers alive at once are bounded by the lookahead, whatever M
        assert max(p.max_pending_recvs for p in plans) <= lookahead + 1


def test_every_receive_is_posted_before_its_consumer_and_no_earlier_than_the_lookahead():
    sched = registry.build("zbv", 4, 16, 2)
    for plan in build_plans(sched, lookahead=2):
        posted = {m: b for b, groups in enumerate(plan.issue) for g in groups for m in g.recvs}
        for i, a in enumerate(plan.parts):
            msg = needed_by(a, sched, plan.rank)
            if msg is not None:
                assert i - 2 <= posted[msg] <= i, (plan.rank, str(a))


def test_validation_forward_pass_uses_the_training_plan_without_its_backward():
    sched = registry.build("1f1b", 4, 8, 1)
    for plan in build_plans(sched):
        fwd = forward_plan(plan)
        assert [str(a) for a in fwd.parts] == [str(a) for a in plan.parts if a.op.value == "F"]
        for peer in range(4):  # per peer, every activation message of the training plan, in its order
            msgs = [m for gs in fwd.issue for g in gs if g.peer == peer for m in g.sends + g.recvs]
            assert all(m.kind is Kind.ACT for m in msgs)
            assert msgs == [m for gs in plan.issue for g in gs if g.peer == peer
                            for m in g.sends + g.recvs if m.kind is Kind.ACT]


GOOD = """\
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
1RECV_F0,1F0,1RECV_F1,1BW0,1SEND_B0,1F1,1BW1,1SEND_B1
"""
# rank 1 sends 1B0's gradient before taking 0F1's activation; rank 0 sends 0F1 before taking 1B0:
# on one in-order NCCL stream both sends wait for receives queued behind them.
CROSSED = """\
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
1RECV_F0,1F0,1BW0,1SEND_B0,1RECV_F1,1F1,1BW1,1SEND_B1
"""
# rank 1 receives 0F1's activation first, rank 0 sends 0F0's first: NCCL would hand 0F0's tensor to 1RECV_F1.
SWAPPED = """\
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
1RECV_F1,1RECV_F0,1F0,1BW0,1SEND_B0,1F1,1BW1,1SEND_B1
"""


def load_path(tmp_path, text):
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return path


def load(tmp_path, text):
    return registry.load_custom(load_path(tmp_path, text), num_ranks=2, num_microbatches=2)


def test_hand_written_plan_round_trips_and_is_used(tmp_path):
    sched = load(tmp_path, GOOD)
    validate(sched)
    assert sched.to_csv() == GOOD.replace("BW", "B")  # written back in torch's names (its B: full backward)
    assert registry.load_custom(load_path(tmp_path, sched.to_csv()), num_ranks=2, num_microbatches=2) == sched
    again = Schedule.from_text(sched.to_text(), name="custom", placement=sched.placement, num_microbatches=2)
    assert again == sched
    plan = build_plans(sched)[1]
    act = lambda m: Message(Kind.ACT, 0, m, 0, 1)  # noqa: E731
    assert [g.recvs for g in plan.issue[0]] == [(act(0),)]
    assert [g.recvs for g in plan.issue[1]] == [(act(1),)]  # where the file puts 1RECV_F1: after 1F0


def test_crossed_hand_written_plan_is_refused_in_one_line(tmp_path):
    sched = load(tmp_path, CROSSED)
    validate(Schedule.build("custom", sched.placement, 2, [list(row) for row in sched.steps]))  # derived plan: fine
    with pytest.raises(ScheduleError) as e:
        validate(sched)
    line = str(e.value).splitlines()[0]
    assert line == ("schedule 'custom': ranks 0 and 1 issue two messages in opposite orders: rank 0 issues the "
                    "activation of 0F1 before the input gradient of 1B0, rank 1 the other way round; on NCCL (one "
                    "in-order stream per pair) that deadlocks: reorder the schedule so both ranks meet them in one "
                    "order")


def test_swapped_receives_are_refused_naming_both_messages(tmp_path):
    with pytest.raises(ScheduleError) as e:
        validate(load(tmp_path, SWAPPED))
    line = str(e.value).splitlines()[0]
    assert "ranks 0 and 1" in line and "activation of 0F0" in line and "activation of 0F1" in line


@pytest.mark.parametrize("text,needle", [
    (GOOD.replace("1RECV_F1,", ""), "rank 1 must receive the activation of 0F1 before 1F1: add 1RECV_F1"),
    (GOOD.replace("0SEND_F1,", ""), "rank 0 must send the activation of 0F1 after 0F1: add 0SEND_F1"),
    (GOOD.replace("0F0,0SEND_F0", "0SEND_F0,0F0"), "rank 0 must send the activation of 0F0 after 0F0"),
    (GOOD.replace("1RECV_F0,", "1RECV_F0,1RECV_F0,"), "rank 1 lists 1RECV_F0 twice"),
    (GOOD.replace("0RECV_B1,", "0RECV_B1,1SEND_B1,"), "1SEND_B1 is on rank 0, but stage 1 is not"),
])
def test_incomplete_hand_written_plan_says_what_to_add(tmp_path, text, needle):
    with pytest.raises(ScheduleError, match=needle):
        validate(load(tmp_path, text))
