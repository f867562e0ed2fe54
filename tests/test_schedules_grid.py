"""The issue's acceptance grid over every built-in schedule (pure Python, no torch).

- P in {2, 4, 8}, M from each schedule's minimum to 4P: complete, deadlock-free, text and CSV round trip.
- F = B = W per rank's share, no communication: simulated bubble equals the published one (GPipe, 1F1B,
  interleaved v=2, ZB-H1, DualPipe, DualPipe-V); ZB-H2 and ZB-V are at most ZB-H1's.
- Peak live activation sets: M for GPipe, P-r for 1F1B, P for ZB-H1, P+1 for DualPipe, 2P+1 for DualPipe-V,
  at most 2P for ZB-V.
"""

import pytest

from pipetrain.schedules import registry
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.spec import RankCosts
from pipetrain.schedules.validate import validate

pytestmark = pytest.mark.pure

V = {"interleaved_1f1b": 2, "looped_bfs": 2}


def valid_cases():
    for name in registry.names():
        spec = registry.get(name)
        for P in (2, 4, 8):
            v = V.get(name, spec.fixed_stages_per_rank or 1)
            for M in range(1, 4 * P + 1):
                if spec.is_valid(P, M, v):
                    yield name, P, M, v


CASES = list(valid_cases())


def test_every_schedule_has_grid_cases():
    for name in registry.names():
        ms = sorted({M for n, P, M, _ in CASES if n == name and P == 4})
        assert ms and ms[-1] == 16, (name, ms)


@pytest.mark.parametrize("name,P,M,v", CASES, ids=[f"{n}-P{P}-M{M}" for n, P, M, _ in CASES])
def test_complete_deadlock_free_and_round_trips(name, P, M, v):
    sched = registry.build(name, P, M, v)
    validate(sched)
    text = Schedule.from_text(sched.to_text(), name=name, placement=sched.placement, num_microbatches=M)
    assert text == sched
    csv = Schedule.from_csv(sched.to_csv(), name=name, placement=sched.placement, num_microbatches=M)
    assert csv == sched


def rank_share_equal(name, P, M, v, share=1.0):
    """Simulate with F = B = W = `share` per rank's share of the model (stage cost = share / stages of
    one copy per rank)."""
    sched = registry.build(name, P, M, v)
    per_stage = share / (sched.placement.stages_per_rank / sched.placement.param_copies)
    res = simulate(sched, StageCosts.uniform(sched.placement.num_stages, per_stage, per_stage, per_stage))
    return sched, res


ANALYTIC_EXACT = ["gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipe", "dualpipev"]


@pytest.mark.parametrize("name", ANALYTIC_EXACT)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_bubble_equals_published(name, P):
    spec = registry.get(name)
    for _, p, M, v in [c for c in CASES if c[0] == name and c[1] == P]:
        sched, res = rank_share_equal(name, p, M, v)
        analytic = spec.analytic_bubble(P, sched.placement.stages_per_rank, RankCosts(1.0, 1.0, 1.0, 3.0))
        for r, idle in enumerate(res.idle_per_rank):
            assert idle == pytest.approx(analytic, abs=1e-9), (name, P, M, r)


@pytest.mark.parametrize("name", ["zbh2", "zbv"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_zbh2_and_zbv_at_most_zbh1(name, P):
    for _, _, M, v in [c for c in CASES if c[0] == name and c[1] == P]:
        if not registry.get("zbh1").is_valid(P, M):
            continue
        _, res = rank_share_equal(name, P, M, v)
        _, ref = rank_share_equal("zbh1", P, M, 1)
        assert res.makespan <= ref.makespan + 1e-9, (name, P, M)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_peak_live_activations(P):
    def peaks(name, M):
        v = V.get(name, registry.get(name).fixed_stages_per_rank or 1)
        return list(rank_share_equal(name, P, M, v)[1].peak_activations_per_rank)

    for M in (2 * P, 4 * P):
        assert peaks("gpipe", M) == [M] * P
        assert peaks("1f1b", M) == [P - r for r in range(P)]
        assert peaks("zbh1", M) == [P] * P
        assert peaks("dualpipe", M) == [P + 1] * P
        assert peaks("dualpipev", M) == [2 * P + 1] * P
        assert max(peaks("zbv", M)) <= 2 * P


def test_fast_enough_for_big_pipelines():
    """P=32, M=256 must simulate quickly (the timed figure lives in bench/; this only guards blowups)."""
    import time

    t0 = time.perf_counter()
    sched = registry.build("zbv", 32, 256, 2)
    simulate(sched)
    assert time.perf_counter() - t0 < 30
