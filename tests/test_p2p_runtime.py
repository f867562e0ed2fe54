"""Tier 2 (real gloo processes): the in-order point-to-point mode behaves like NCCL.

`pipeline.p2p_in_order` makes gloo match messages by position and run a rank's groups
toward one peer one after another. A plan whose two sides cross (each sends before
receiving what the other sends first) deadlocks there as on NCCL, and fails within the
timeout with a message that says so; the plain gloo mode (a tag per message) lets the same
plan through, which is why the parity tests run in order.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.runtime.comm import P2P, P2PError
from pipetrain.schedules.ir import Action, Op
from pipetrain.schedules.p2p import Group, Kind, Message, RankPlan

pytestmark = pytest.mark.dist

ACT = Message(Kind.ACT, 0, 0, 0, 1)
GRAD = Message(Kind.GRAD, 1, 0, 1, 0)
N = 1 << 16  # floats: large enough that no transport could buffer it without the receive


def crossed(rank: int) -> RankPlan:
    """Both ranks send first, then receive what the other sent: fine with tags, a deadlock in order."""
    mine, theirs = (ACT, GRAD) if rank == 0 else (GRAD, ACT)
    parts = (Action(Op.F, rank, 0), Action(Op.BW, rank, 0))
    return RankPlan(rank, parts, (None, theirs),
                    ((Group(1 - rank, (mine,), ()),), (Group(1 - rank, (), (theirs,)),), ()))


def run_crossed(rank: int, world: int, out, in_order: bool) -> None:
    plan = crossed(rank)
    comm = P2P(rank, num_microbatches=1, timeout_s=3.0, in_order=in_order)
    comm.begin(plan, lambda m: torch.empty(N))
    comm.produced(plan.issue[0][0].sends[0], torch.full((N,), float(rank)))
    try:
        comm.issue(0)
        comm.issue(1)
        got = comm.receive(plan.waits[1], action="BW")
        comm.issue(2)
        comm.finish()
        (out / f"ok{rank}").write_text(str(float(got[0])))
    except P2PError as e:
        (out / f"err{rank}").write_text(str(e))


@pytest.mark.parametrize("in_order", [False, True])
def test_crossed_plan_deadlocks_only_in_order(tmp_path, in_order):
    spawn(run_crossed, 2, tmp_path, in_order)
    if not in_order:
        assert (tmp_path / "ok0").read_text() == "1.0" and (tmp_path / "ok1").read_text() == "0.0"
        return
    for r in range(2):
        err = (tmp_path / f"err{r}").read_text()
        assert f"rank {r}:" in err and "in-order" in err and "different orders" in err, err
