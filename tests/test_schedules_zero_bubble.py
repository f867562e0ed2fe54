"""ZB-H1, ZB-H2 and ZB-V: structure, constraints, and simulated bubble / memory.

Costs: zbh1/zbh2 hold one stage per rank, so a stage costs a rank's share. zbv holds
two half-size stages per rank, so it gets half the per-stage cost: both then do the
same work per rank and their bubbles compare directly.
"""

from __future__ import annotations

import re

import pytest

from pipetrain.schedules.ir import Op, Schedule
from pipetrain.schedules.simulate import SimResult, StageCosts, simulate
from pipetrain.schedules.spec import RankCosts, ScheduleSpec
from pipetrain.schedules.validate import validate
from pipetrain.schedules.zero_bubble import SPECS, zbh1, zbv

pytestmark = pytest.mark.pure

SPEC = {s.name: s for s in SPECS}
RANKS = (2, 4, 8)
MIN_M = {"zbh1": lambda P: P, "zbh2": lambda P: 2 * P - 1, "zbv": lambda P: 1}
EQUAL = (1.0, 1.0, 1.0)
UNEQUAL = (1.0, 1.5, 0.5)  # W < F < B, the paper's regime (Section 2)
HEAVY_W = (0.5, 1.0, 1.5)  # W > B > F: outside the paper's regime


def grid(name: str) -> list[tuple[int, int]]:
    return [(P, M) for P in RANKS for M in range(MIN_M[name](P), 4 * P + 1)]


def sim(name: str, P: int, M: int, rank_costs: tuple[float, float, float]) -> SimResult:
    """Build through the spec (so its check runs) and simulate with rank-share costs."""
    spec = SPEC[name]
    sched = spec.build(P, M)
    per_stage = tuple(c / spec.stages_per_rank(1) for c in rank_costs)
    return simulate(sched, StageCosts.uniform(sched.placement.num_stages, *per_stage), comm_ms=0.0)


def raw(gen, spec: ScheduleSpec, P: int, M: int) -> Schedule:
    """Generate without the spec's check (to compare below a schedule's minimum M)."""
    return Schedule.build(spec.name, spec.placement(P), M, gen(P, M, spec.stages_per_rank(1)))


def rank_costs(c: tuple[float, float, float]) -> RankCosts:
    return RankCosts(F=c[0], B=c[1], W=c[2], FB=sum(c))


# ---------------------------------------------------------------- the registry entries
def test_specs_names_order_and_placement():
    assert [s.name for s in SPECS] == ["zbh1", "zbh2", "zbv"]
    assert [s.placement_kind for s in SPECS] == ["loop", "loop", "v"]
    assert [s.fixed_stages_per_rank for s in SPECS] == [1, 1, 2]
    assert SPEC["zbh1"].analytic_bubble is not None
    assert SPEC["zbh2"].analytic_bubble is None  # paper's formula needs post-validation
    for s in SPECS:
        # one sentence: ends with a full stop, no full stop before a new capitalised sentence
        assert s.description.endswith(".") and not re.search(r"\.\s+[A-Z]", s.description)


@pytest.mark.parametrize("name", ["zbh1", "zbh2", "zbv"])
def test_valid_and_split_backward_only(name):
    for P, M in grid(name) + [(1, 1), (1, 3), (3, 7), (5, 11)]:
        sched = SPEC[name].build(P, M)
        validate(sched)
        ops = {a.op for r in range(P) for a in sched.actions(r)}
        assert ops == {Op.F, Op.B, Op.W}, (name, P, M, ops)


def test_paper_figure_3_order():
    """P=4, M=8 as drawn in the paper (0-based microbatches)."""
    h1 = SPEC["zbh1"].build(4, 8).to_text().splitlines()
    assert h1[0] == "rank 0: " + " ".join(
        ["0F0", "0F1", "0F2", "0F3"]
        + [f"0B{k} 0W{k} 0F{k + 4}" for k in range(4)]
        + [f"0B{k} 0W{k}" for k in range(4, 8)]
    )
    assert h1[3] == "rank 3: " + " ".join(
        [f"3F{k} 3B{k}" for k in range(4)]
        + [f"3W{k} 3F{k + 4} 3B{k + 4}" for k in range(4)]
        + [f"3W{k}" for k in range(4, 8)]
    )
    h2 = SPEC["zbh2"].build(4, 8).to_text().splitlines()
    assert h2[0] == "rank 0: " + " ".join(
        [f"0F{k}" for k in range(7)] + ["0B0 0W0 0F7"] + [f"0B{k} 0W{k}" for k in range(1, 8)]
    )
    assert h2[3] == "rank 3: " + " ".join(
        [f"3F{k} 3B{k}" for k in range(7)] + ["3W0 3F7 3B7"] + [f"3W{k}" for k in range(1, 8)]
    )


def test_zbv_first_rank_follows_torch_phases():
    """Rank 0 of ZB-V for P=2, M=4: 3 forwards of stage 0, then F B W of the loss stage 3."""
    row = SPEC["zbv"].build(2, 4).to_text().splitlines()[0]
    assert row.startswith("rank 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2")


# ---------------------------------------------------------------- constraints
@pytest.mark.parametrize(
    "name,P,M,knob",
    [
        ("zbh1", 4, 3, "pipeline.microbatches"),
        ("zbh1", 8, 1, "pipeline.microbatches"),
        ("zbh2", 4, 6, "pipeline.microbatches"),
        ("zbh2", 2, 2, "pipeline.microbatches"),
        ("zbv", 4, 0, "pipeline.microbatches"),
        ("zbh1", 0, 4, "pipeline.degree"),
        ("zbv", 0, 4, "pipeline.degree"),
    ],
)
def test_constraint_violations_name_the_knob(name, P, M, knob):
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")) as info:
        SPEC[name].build(P, M)
    assert "\n" not in str(info.value)
    assert not SPEC[name].is_valid(P, M)


def test_minimum_m_is_accepted():
    for P in (1, *RANKS):
        for name in SPEC:
            assert SPEC[name].is_valid(P, MIN_M[name](P))


# ---------------------------------------------------------------- zbh1: exact bubble and memory
@pytest.mark.parametrize("costs", [EQUAL, UNEQUAL, HEAVY_W])
def test_zbh1_idle_matches_analytic_on_every_rank(costs):
    for P, M in grid("zbh1"):
        r = sim("zbh1", P, M, costs)
        want = SPEC["zbh1"].analytic_bubble(P, 1, rank_costs(costs))
        assert r.idle_per_rank == pytest.approx((want,) * P, abs=1e-9), (P, M, costs)


def test_zbh1_equal_costs_is_papers_formula_exactly_with_peak_P():
    for P, M in grid("zbh1"):
        r = sim("zbh1", P, M, EQUAL)
        f, b, w = EQUAL
        assert all(idle == (P - 1) * (f + b - w) for idle in r.idle_per_rank), (P, M)
        assert r.peak_activations_per_rank == (P,) * P, (P, M)


def test_zbh1_papers_formula_in_its_regime():
    f, b, w = UNEQUAL
    for P, M in grid("zbh1"):
        r = sim("zbh1", P, M, UNEQUAL)
        assert r.idle_per_rank == pytest.approx(((P - 1) * (f + b - w),) * P), (P, M)


def test_zbh1_below_minimum_m_misses_the_formula():
    """Why M >= P: with fewer microbatches the bubble is larger than the formula."""
    spec = SPEC["zbh1"]
    r = simulate(raw(zbh1, spec, 4, 3), StageCosts.uniform(4))
    assert max(r.idle_per_rank) > spec.analytic_bubble(4, 1, rank_costs(EQUAL))


# ---------------------------------------------------------------- zbh2 / zbv against zbh1
@pytest.mark.parametrize("costs", [EQUAL, UNEQUAL, HEAVY_W])
def test_zbh2_bubble_not_above_zbh1(costs):
    for P, M in grid("zbh2"):
        h1 = sim("zbh1", P, M, costs)
        h2 = sim("zbh2", P, M, costs)
        assert h2.bubble_fraction_mean <= h1.bubble_fraction_mean + 1e-12, (P, M, costs)
        assert max(h2.peak_activations_per_rank) <= 2 * P - 1, (P, M)


def test_zbh2_beats_zbh1_when_b_exceeds_w():
    f, b, w = UNEQUAL
    for P, M in grid("zbh2"):
        h2 = sim("zbh2", P, M, UNEQUAL)
        # measured (P-1) max(F+B-2W, F, B-F); ZB-H1 has (P-1)(F+B-W)
        want = (P - 1) * max(f + b - 2 * w, f, b - f)
        assert h2.idle_per_rank == pytest.approx((want,) * P), (P, M)
        assert want < (P - 1) * (f + b - w)


@pytest.mark.parametrize("costs", [EQUAL, UNEQUAL, HEAVY_W])
def test_zbv_bubble_not_above_zbh1_and_peak_at_most_2P(costs):
    h1_spec = SPEC["zbh1"]
    for P, M in grid("zbv"):
        v = sim("zbv", P, M, costs)
        # below zbh1's minimum M, compare with the unchecked zbh1 order
        h1 = simulate(raw(zbh1, h1_spec, P, M), StageCosts.uniform(P, *costs))
        assert v.bubble_fraction_mean <= h1.bubble_fraction_mean + 1e-12, (P, M, costs)
        assert max(v.peak_activations_per_rank) <= 2 * P, (P, M, costs)


def test_zbv_reaches_start_up_bound_with_enough_microbatches():
    """With F=B=W and M >= 2P-1 every rank idles only the last rank's start-up wait:
    P-1 half-size forwards, half of ZB-H1's (P-1)F."""
    for P in RANKS:
        for M in range(2 * P - 1, 4 * P + 1):
            r = sim("zbv", P, M, EQUAL)
            assert r.idle_per_rank == pytest.approx(((P - 1) * 0.5,) * P), (P, M)


def test_zbv_small_m_drops_whole_microbatches():
    """M < 2P-1: the order is the 2P-1 one with the extra microbatches removed."""
    spec = SPEC["zbv"]
    small, full = raw(zbv, spec, 4, 3), raw(zbv, spec, 4, 7)
    for r in range(4):
        kept = [a for a in full.actions(r) if a.microbatch < 3]
        assert list(small.actions(r)) == kept
