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
from pipetrain.schedules.p2p import Group, Kind, Message, RankTransfers

pytestmark = pytest.mark.dist

ACT = Message(Kind.ACT, 0, 0, 0, 1)
GRAD = Message(Kind.GRAD, 1, 0, 1, 0)
N = 1 << 16  # floats: large enough that no transport could buffer it without the receive


def crossed(rank: int) -> RankTransfers:
    """Both ranks send first, then receive what the other sent: fine with tags, a deadlock in order."""
    mine, theirs = (ACT, GRAD) if rank == 0 else (GRAD, ACT)
    parts = (Action(Op.F, rank, 0), Action(Op.BW, rank, 0))
    return RankTransfers(rank, parts, (None, theirs),
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


# ---- the transport (pipeline.p2p_transport) on a 4-rank looped pipeline ---------------------------
# interleaved_1f1b P=4 v=2 M=4, lookahead 1: the review's case (F1). Boundary tensors of
# MB x WIDTH floats = 256 KiB, too large for gloo to complete a send before its receive is posted.
MB, WIDTH, M4 = 512, 128, 4


def mlp(device: str = "cpu"):
    from pipetrain.models.factory import build_model

    with torch.device(device):
        return build_model("mlp", n_layer=8, d_hidden=WIDTH)


def mlp_batches(model):
    g = torch.Generator().manual_seed(7)
    return [model.example_batch(microbatch=MB, seq=1, generator=g) for _ in range(M4)]


def run_transports(rank: int, world: int, out, timeout_s: float) -> None:
    """pair_groups first (must train), then one_group in the in-order mode with the validator bypassed
    (registry.build does not validate): it must hang as NCCL would, and fail with P2PError in time."""
    import threading
    import time

    from pipetrain.partition.uniform import uniform_bounds
    from pipetrain.schedules import registry
    from pipetrain.train.pipeline import Transport, build_rank_pipeline

    sched = registry.build("interleaved_1f1b", world, M4, 2)
    for transport in ("pair_groups", "one_group"):
        model = mlp("meta")
        rp = build_rank_pipeline(model, uniform_bounds(8, 8), sched, rank, microbatch_size=MB, seed=0,
                                 transport=Transport(timeout_s=timeout_s, in_order=True, kind=transport))
        t0 = time.monotonic()
        try:
            res = rp.train_step(mlp_batches(model))
        except P2PError as e:
            (out / f"{transport}-err{rank}").write_text(f"{time.monotonic() - t0:.1f} {e}")
            return  # its stream threads stay stuck in waits (daemons): nothing runs after it
        streams = sorted(t.name for t in threading.enumerate() if t.name.startswith("p2p-stream"))
        torch.save({"loss": res.loss, "grads": {n: p.grad for _, n, p in rp.named_parameters()},
                    "streams": streams}, out / f"{transport}-rank{rank}.pt")
        rp.close()


@pytest.fixture(scope="module")
def transports(tmp_path_factory):
    out = tmp_path_factory.mktemp("transports")
    spawn(run_transports, 4, out, 2.0)
    return out


def test_pair_groups_in_order_match_single_process(transports):
    """Parity in the in-order mode that emulates NCCL with a stream per pair (one thread per peer)."""
    model = mlp()
    total = 0.0
    for x, y in mlp_batches(model):
        loss = model.loss(model(x), y)
        total += loss.item()
        (loss / M4).backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for r in range(4):
        got = torch.load(transports / f"pair_groups-rank{r}.pt")
        assert got["loss"] == pytest.approx(total / M4, abs=1e-5)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, ref[n], atol=1e-5, rtol=0, msg=f"rank {r} grad {n}")
            seen.add(n)
        # one in-order stream per peer: the neighbours, and for ranks 0 and 3 the loop's wrap-around
        peers = {0: (1, 3), 1: (0, 2), 2: (1, 3), 3: (0, 2)}[r]
        assert got["streams"] == [f"p2p-stream-{p}" for p in peers], got["streams"]
    assert seen == set(ref)


def test_one_group_in_order_hangs_as_nccl_would(transports):
    """one_group: ONE in-order stream per rank, carrying its groups to both neighbours in issue order.
    The plan the validator refuses for one_group (test_p2p_streams.py) really deadlocks here: the
    ranks fail with P2PError within the timeout instead of training."""
    errors = {r: (transports / f"one_group-err{r}").read_text() for r in range(4)
              if (transports / f"one_group-err{r}").exists()}
    assert not list(transports.glob("one_group-rank*.pt")), "one_group trained: the emulation missed the hang"
    assert len(errors) == 4, errors
    for r, text in errors.items():
        seconds, message = text.split(" ", 1)
        assert float(seconds) < 30 and f"rank {r}:" in message and "in-order" in message, text
