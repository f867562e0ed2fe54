"""Tier 1 (pure), one e2e: the point-to-point plan under the stream rule of its transport.

NCCL runs a process group's `batch_isend_irecv` groups on one stream, in issue order. With
`pipeline.p2p_transport=pair_groups` (the default) every pair of ranks has its own 2-rank group,
so its own stream: no built-in schedule deadlocks under that rule, whatever P, M, v, lookahead,
training or forward-only. With `one_group` a rank's groups to all peers share one stream, where
interleaved_1f1b and looped_bfs deadlock (review F1, Appendix A): the validator refuses such a
plan before any process starts, in one line naming the ranks, the messages and the knob.
"""

from __future__ import annotations

import pytest

from conftest import run_cli
from pipetrain.config import PipelineConfig
from pipetrain.plan import build_schedule
from pipetrain.schedules import registry
from pipetrain.schedules.p2p import PlanError, exchange_pairs
from pipetrain.schedules.p2p_check import check_plan
from pipetrain.schedules.validate import ScheduleError, check_deadlock_free, validate

FAST_M = (1, 2, 3, 4, 5, 8, 16, 32)  # the rest of M in 1..24 is the slow test below
pure = pytest.mark.pure  # every test here but the last, the CLI's (e2e)


def deadlocks(name: str, microbatches, streams: str) -> list[tuple]:
    """Every (P, M, v, lookahead) of `name` whose training or forward-only plan does not complete."""
    entry, bad = registry.get(name), []
    for P in (2, 3, 4, 8):
        for M in microbatches:
            for v in [entry.fixed_stages_per_rank] if entry.fixed_stages_per_rank else (1, 2, 3, 4):
                if not entry.is_valid(P, M, v):
                    continue
                sched = registry.build(name, P, M, v)
                unit_walk = check_deadlock_free(sched)
                for lookahead in (0, 1, 2):
                    try:  # run=True: rule (3) on the training plan and then the forward-only plan
                        check_plan(sched, lookahead=lookahead, unit_walk=unit_walk, run=True, streams=streams)
                    except PlanError as e:
                        bad.append((P, M, v, lookahead, str(e)))
    return bad


@pure
@pytest.mark.parametrize("name", registry.names())
def test_no_built_in_schedule_deadlocks_with_a_stream_per_pair(name):
    assert deadlocks(name, FAST_M, "pair") == []


@pure
@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_no_built_in_schedule_deadlocks_with_a_stream_per_pair_every_m(name):
    # the M of FAST_M (32 among them) were checked by the test above
    assert deadlocks(name, [m for m in range(1, 25) if m not in FAST_M], "pair") == []


@pure
def test_one_stream_per_rank_deadlocks_where_the_review_says():
    """Appendix A at P=4, M=4 (8 where a schedule needs more), lookahead 1: only the looped placements
    deadlock on one stream per rank."""
    hit = {}
    for name in registry.names():
        entry = registry.get(name)
        v = entry.fixed_stages_per_rank or (2 if name in ("interleaved_1f1b", "looped_bfs") else 1)
        M = 4 if entry.is_valid(4, 4, v) else 8  # zbh2 and DualPipe take more microbatches
        sched = registry.build(name, 4, M, v)
        try:
            check_plan(sched, lookahead=1, run=True, streams="rank")
            hit[name] = False
        except PlanError:
            hit[name] = True
        check_plan(sched, lookahead=1, run=True, streams="pair")  # and every one passes per pair
    assert {n for n, h in hit.items() if h} == {"interleaved_1f1b", "looped_bfs"}
    assert set(hit) == set(registry.names())


@pure
def test_review_case_refused_on_one_group_in_one_line_naming_ranks_and_messages():
    """interleaved_1f1b P=4 v=2 M=4 lookahead 1: rank 0 needs 3F0 from rank 3 (the wrap-around), which
    needs 2F0, whose send rank 2 queued behind a receive from rank 1, ... back to rank 0."""
    sched = registry.build("interleaved_1f1b", 4, 4, 2)
    validate(sched, p2p_lookahead=1)  # the default transport: a stream per pair
    validate(sched, p2p_lookahead=1, p2p_transport="pair_groups")
    with pytest.raises(ScheduleError) as e:
        validate(sched, p2p_lookahead=1, p2p_transport="one_group")
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("schedule 'interleaved_1f1b': point-to-point plan deadlocks on NCCL with one stream per "
                           "rank: rank 0 waits before 4F0 for the activation of 3F0 from rank 3; rank 3 has not "
                           "posted its send of it: it waits before 3F0 for the activation of 2F0 from rank 2; rank 2 "
                           "queued its send of it behind its receive of the activation of 1F1 from rank 1;"), text
    # the chain closes where it began, and the line ends with the knobs that make it pass
    assert text.endswith("behind its receive of the activation of 3F0 from rank 3: set "
                         "pipeline.p2p_transport=pair_groups or pipeline.p2p_lookahead=0"), text
    validate(sched, p2p_lookahead=0, p2p_transport="one_group")  # as the message says


@pure
def test_looped_bfs_on_one_group_is_told_only_the_knob_that_works():
    sched = registry.build("looped_bfs", 3, 4, 2)
    with pytest.raises(ScheduleError) as e:
        validate(sched, p2p_lookahead=1, p2p_transport="one_group")
    assert str(e.value).endswith(": set pipeline.p2p_transport=pair_groups"), str(e.value)
    with pytest.raises(ScheduleError):  # lookahead 0 does not save looped_bfs (Appendix A)
        validate(sched, p2p_lookahead=0, p2p_transport="one_group")


@pure
def test_the_run_validates_its_configured_transport(compose):
    """plan.build_schedule (what every mode runs before any process starts) reads pipeline.p2p_transport."""
    base = ["model=sleep", "schedule=interleaved_1f1b", "pipeline.degree=4", "schedule.virtual_stages=2",
            "pipeline.microbatches=4"]
    assert compose(base).pipeline.p2p_transport == "pair_groups"
    build_schedule(compose(base))
    with pytest.raises(ScheduleError, match="one stream per rank: rank 0 waits"):
        build_schedule(compose(base + ["pipeline.p2p_transport=one_group"]))


@pure
def test_unknown_transport_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^pipeline.p2p_transport must be pair_groups or one_group \(got 'nccl'\)$"):
        PipelineConfig(p2p_transport="nccl")


@pure
@pytest.mark.parametrize("name,P,v,pairs", [
    ("1f1b", 4, 1, ((0, 1), (1, 2), (2, 3))),
    ("interleaved_1f1b", 4, 2, ((0, 1), (0, 3), (1, 2), (2, 3))),  # the loop's wrap-around 3 -> 0
    ("looped_bfs", 3, 2, ((0, 1), (0, 2), (1, 2))),
    ("dualpipev", 4, 2, ((0, 1), (1, 2), (2, 3))),  # the V turns on rank 3: no wrap-around pair
])
def test_pairs_that_get_a_process_group_are_those_that_exchange_tensors(name, P, v, pairs):
    assert exchange_pairs(registry.build(name, P, 2 * P, v)) == pairs


@pytest.mark.e2e
def test_simulate_refuses_a_one_group_plan_that_would_hang_and_accepts_the_default(tmp_path):
    """The issue's done-when command: one line naming ranks and messages, exit code non-zero."""
    cmd = ["mode=simulate", "model=sleep", "schedule=interleaved_1f1b", "pipeline.degree=4",
           "schedule.virtual_stages=2", "pipeline.microbatches=4", f"hydra.run.dir={tmp_path / 'r'}"]
    bad = run_cli(cmd + ["pipeline.p2p_transport=one_group"], cwd=tmp_path)
    assert bad.returncode != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 0 waits before 4F0 for the activation of 3F0 from rank 3" in lines[0], bad.stderr
    assert "pipeline.p2p_transport=pair_groups" in lines[0]
    ok = run_cli(cmd, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


@pure
def test_nccl_waits_are_stream_waits_gloo_waits_are_timed():
    """Review F5: on NCCL `Work.wait(timeout)` blocks the host until the kernels finish, so the transport
    calls `wait()` there (the pair group's timeout ends a hang); gloo keeps its timed waits. The GPU
    tier checks the host time of both waits behind a GPU sleep."""
    from pipetrain.runtime.comm import host_timed_wait

    assert host_timed_wait("gloo") is True
    assert host_timed_wait("nccl") is False
