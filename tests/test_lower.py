"""schedules/lower.py: a compiled stage's B becomes BW and its W goes, as a pure pass over the IR,
applied once where the run's schedule is built (plan.build_schedule), before the gradient
reductions are placed, so schedule.csv, the timeline, the simulation and the executor read one
schedule: on ZB-V, on DualPipe's F&B pairs, on a hand-written CSV with explicit SEND/RECV."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from conftest import run_cli
from pipetrain.plan import build_schedule, make_plan
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Action, Comm, Op, Overlap, Reduce, Schedule
from pipetrain.schedules.lower import fuse_backward, split_on
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.reduce import add_reduces, check_reduces
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.validate import validate


def backwards(schedule: Schedule, rank: int) -> list[tuple[int, int]]:
    """(stage, microbatch) of each B or BW of a rank, in order."""
    return [(a.stage, a.microbatch) for a in schedule.actions(rank) if a.op.is_backward]


@pytest.mark.pure
@pytest.mark.parametrize("compiled", [{0, 1, 2, 3}, {0}, {1, 2}])
def test_zbv_compiled_stages_run_bw_where_b_was_and_no_w(compiled):
    zbv = registry.build("zbv", 2, 8, 2)
    low = fuse_backward(zbv, compiled)
    validate(low)
    assert not split_on(low, compiled) and split_on(zbv, compiled)
    for r in range(2):
        before, after = list(zbv.actions(r)), list(low.actions(r))
        assert [a for a in after if a.stage not in compiled] == [a for a in before if a.stage not in compiled]
        assert [a for a in after if a.op is Op.F] == [a for a in before if a.op is Op.F]
        assert backwards(low, r) == backwards(zbv, r)  # each backward where its B was
        assert {a.op for a in after if a.stage in compiled} <= {Op.F, Op.BW}
    assert sum(a.op is Op.BW for r in range(2) for a in low.actions(r)) == len(compiled) * 8
    assert fuse_backward(low, compiled) == low  # lowered once is lowered


@pytest.mark.pure
def test_lowered_zbv_simulates_as_the_fused_costs_did_and_frees_at_bw():
    """Costed as compiled stages were before the pass (B = b + w, W = 0 ms), the lowered schedule has
    the same makespan; an activation set now ends at its BW, not at a W that did nothing."""
    zbv = registry.build("zbv", 4, 16, 2)
    f, b, w = [1.0, 1.2, 0.8, 1.1] * 2, [1.0, 0.9, 1.3, 1.0] * 2, [0.7, 0.8, 0.9, 0.6] * 2
    fused = StageCosts(tuple(f), tuple(x + y for x, y in zip(b, w)), (0.0,) * 8)
    low = fuse_backward(zbv, range(8))
    old, new = simulate(zbv, fused), simulate(low, StageCosts(tuple(f), tuple(b), tuple(w)))
    assert new.makespan == pytest.approx(old.makespan) and new.busy_per_rank == pytest.approx(old.busy_per_rank)
    assert all(n <= o for n, o in zip(new.peak_activations_per_rank, old.peak_activations_per_rank))


@pytest.mark.pure
@pytest.mark.parametrize("name, ranks", [("dualpipev", 2), ("dualpipev", 4), ("dualpipe", 4)])
def test_dualpipe_pairs_stay_and_their_split_backwards_fuse(name, ranks):
    """DualPipe pairs a forward with a full backward (F&BW): a compiled stage's pair is unchanged; the
    B and W it splits elsewhere (zero bubble) fuse into one BW where the B was."""
    dp = registry.build(name, ranks, 2 * ranks, 2)
    stages = range(dp.placement.num_stages)
    low = fuse_backward(dp, stages)
    validate(low)
    for r in range(ranks):
        pairs = [s for s in dp.steps[r] if isinstance(s, Overlap)]
        assert pairs and [s for s in low.steps[r] if isinstance(s, Overlap)] == pairs
        assert backwards(low, r) == backwards(dp, r)
        assert {a.op for a in low.actions(r)} == {Op.F, Op.BW}


@pytest.mark.pure
def test_a_pair_with_a_split_backward_becomes_f_and_bw():
    """An F&B pair whose backward's stage is compiled becomes F&BW and that B's W goes; the pairs and
    Ws of a stage not compiled stay."""
    text = ("rank 0: 0F0 0F1 0F2 0B0 0F3&0B1 0W0 0W1 0B2 0W2 0B3 0W3\n"
            "rank 1: 1F0 1B0 1F1 1W0 1F2 1B1 1W1 1F3&1B2 1W2 1B3 1W3")
    hand = Schedule.from_text(text, name="hand", placement=Placement.loop(2), num_microbatches=4)
    validate(hand)
    low = fuse_backward(hand, {0})
    validate(low)
    assert low.steps[0][4] == Overlap(Action(Op.F, 0, 3), Action(Op.BW, 0, 1))
    assert low.to_text().splitlines()[0] == "rank 0: 0F0 0F1 0F2 0BW0 0F3&0BW1 0BW2 0BW3"
    assert low.steps[1] == hand.steps[1]
    other = fuse_backward(hand, {1})
    assert other.to_text().splitlines() == [text.splitlines()[0], "rank 1: 1F0 1BW0 1F1 1F2 1BW1 1F3&1BW2 1BW3"]


# 2 ranks, 2 microbatches in torch's names (I: input gradient), the point-to-point plan spelled out, a
# gradient reduction after each stage's last W: after lowering stage 1, its sends and receives keep
# their places between the steps, and 1REDUCE_GRAD (after the dropped 1W1) still follows 1BW1.
CSV = """\
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0I0,0RECV_B1,0I1,0W0,0W1,0REDUCE_GRAD
1RECV_F0,1F0,1RECV_F1,1I0,1SEND_B0,1F1,1I1,1SEND_B1,1W0,1W1,1REDUCE_GRAD
"""


@pytest.mark.pure
def test_hand_written_csv_keeps_its_sends_receives_and_reductions_in_place():
    hand = Schedule.from_csv(CSV, name="custom", placement=Placement.loop(2), num_microbatches=2)
    validate(hand)
    low = fuse_backward(hand, {1})
    validate(low)
    check_reduces(low)
    assert low.to_csv().splitlines() == [
        CSV.splitlines()[0],  # stage 0 runs eagerly: untouched
        # torch's B is our BW; at one boundary a reduction comes first (ir.Schedule.cells), both after 1BW1
        "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1REDUCE_GRAD,1SEND_B1",
    ]
    for kind in (Comm, Reduce):
        assert [c for c in low.cells(1) if isinstance(c, kind)] == [c for c in hand.cells(1) if isinstance(c, kind)]


@pytest.mark.pure
def test_reductions_follow_the_last_bw_of_a_compiled_stage():
    """Placed after lowering (as plan.build_schedule does), a compiled stage's REDUCE_GRAD moves up to
    right after its last BW, which computed its gradients, instead of after its last (empty) W."""
    zbv = registry.build("zbv", 2, 8, 2)
    low = add_reduces(fuse_backward(zbv, range(4)))
    for r in range(2):
        cells = low.cells(r)
        for red in (c for c in cells if isinstance(c, Reduce)):
            before = [c for c in cells[:cells.index(red)] if isinstance(c, Action) and c.stage == red.stage]
            assert before[-1].op is Op.BW
            assert not any(isinstance(c, Action) and c.stage == red.stage for c in cells[cells.index(red):])


@pytest.mark.pure
def test_the_plan_carries_compiled_stages_and_lowers_its_schedule(compose):
    base = ["mode=simulate", "model=sleep", "schedule=zbv", "parallel.dp_replicate=2"]
    eager, compiled = (make_plan(compose([*base, f"trainer.compile={c}"])) for c in ("false", "true"))
    assert eager.compiled_stages == frozenset() and compiled.compiled_stages == frozenset(range(4))
    assert compiled.schedule == add_reduces(fuse_backward(dataclasses.replace(eager.schedule, reduces=()), range(4)))
    assert build_schedule(compose([*base, "trainer.compile=true"])) == compiled.schedule


@pytest.mark.e2e
def test_simulate_writes_and_prints_bw_for_compiled_stages(tmp_path: Path):
    """The issue's command: schedule.csv (torch's names: B is the full backward, I the input grad)
    has no I and no W, and the timeline prints BW."""
    res = run_cli(["mode=simulate", "trainer.compile=true", "schedule=zbv", f"hydra.run.dir={tmp_path / 'r'}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = list(csv.reader((tmp_path / "r" / "schedule.csv").read_text().splitlines()))
    ops = {cell.strip("0123456789") for row in rows for cell in row}
    assert ops == {"F", "B"}, ops
    assert "BW" in res.stdout and "legend:  F   BW " in res.stdout


@pytest.mark.pure
def test_a_rank_refuses_compiled_stages_on_a_schedule_not_lowered():
    """The executor has no compile branch: a compiled stage given B and W apart is refused when the
    rank is assembled, before anything is built."""
    from pipetrain.parallel.parallelize import Parallelize
    from pipetrain.train.pipeline import build_rank_pipeline

    zbv = registry.build("zbv", 2, 4, 2)
    with pytest.raises(ValueError, match="compiled stages cannot run B and W apart, but the schedule has 3B0"):
        build_rank_pipeline(None, [range(1)] * 4, zbv, 0, microbatch_size=1,
                            parallelize=Parallelize(compiled=True))  # type: ignore[arg-type]
