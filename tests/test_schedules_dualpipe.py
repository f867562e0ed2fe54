"""DualPipe and DualPipe-V: valid schedules, the published bubble exactly, P+1 / 2P+1 live
activation sets, and constraint errors that name the knob."""

from __future__ import annotations

import pytest

from pipetrain.schedules.dualpipe import SPECS
from pipetrain.schedules.ir import Op, Overlap
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.spec import RankCosts, ScheduleSpec
from pipetrain.schedules.validate import validate

pytestmark = pytest.mark.pure

BY_NAME = {s.name: s for s in SPECS}
DUALPIPE, DUALPIPEV = BY_NAME["dualpipe"], BY_NAME["dualpipev"]


def grid(spec: ScheduleSpec) -> list[tuple[int, int]]:
    step = 2 if spec.name == "dualpipe" else 1
    return [(P, M) for P in (2, 4, 8) for M in range(2 * P, 4 * P + 1, step)]


def stage_share(spec: ScheduleSpec) -> float:
    # A mirror stage is a whole rank share; a V stage is half of one.
    return 1.0 if spec.placement_kind == "mirror" else 0.5


def sim(spec: ScheduleSpec, P: int, M: int, *, fb_overlap: float = 0.0, comm_ms: float = 0.0):
    schedule = spec.build(P, M)
    s = stage_share(spec)
    costs = StageCosts.uniform(schedule.placement.num_stages, s, s, s)
    return simulate(schedule, costs, fb_overlap=fb_overlap, comm_ms=comm_ms)


def test_exported_specs() -> None:
    assert [s.name for s in SPECS] == ["dualpipe", "dualpipev"]
    assert (DUALPIPE.placement_kind, DUALPIPEV.placement_kind) == ("mirror", "v")
    for spec in SPECS:
        assert spec.fixed_stages_per_rank == 2
        assert spec.analytic_bubble is not None
        assert spec.description.count(". ") == 0 and spec.description.endswith(".")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_valid_on_grid(spec: ScheduleSpec) -> None:
    for P, M in grid(spec):
        schedule = spec.build(P, M)
        validate(schedule)
        assert schedule.placement.kind == spec.placement_kind


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_uses_overlap_and_zero_bubble_split(spec: ScheduleSpec) -> None:
    schedule = spec.build(4, 16)
    flat = [step for row in schedule.steps for step in row]
    pairs = [s for s in flat if isinstance(s, Overlap)]
    assert pairs and all(p.backward.op is Op.BW for p in pairs)
    ops = {a.op for r in range(4) for a in schedule.actions(r)}
    assert ops == {Op.F, Op.B, Op.W, Op.BW}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_idle_equals_analytic_bubble_on_every_rank(spec: ScheduleSpec) -> None:
    costs = RankCosts(F=1.0, B=1.0, W=1.0, FB=3.0)
    for P, M in grid(spec):
        result = sim(spec, P, M)
        expected = spec.analytic_bubble(P, 2, costs)
        assert result.idle_per_rank == pytest.approx([expected] * P, abs=1e-9), (P, M)


def test_analytic_values() -> None:
    c = RankCosts(F=1.0, B=1.0, W=1.0, FB=3.0)
    # DualPipe (P/2-1)(F&B+BW-3W); DualPipe-V (P-1)(F&B+BW-3W)/2, with F&B+BW-3W = 2.
    assert [DUALPIPE.analytic_bubble(P, 2, c) for P in (2, 4, 8)] == [0.0, 2.0, 6.0]
    assert [DUALPIPEV.analytic_bubble(P, 2, c) for P in (2, 4, 8)] == [1.0, 3.0, 7.0]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_peak_live_activations(spec: ScheduleSpec) -> None:
    for P, M in grid(spec):
        expected = P + 1 if spec.name == "dualpipe" else 2 * P + 1
        assert sim(spec, P, M).peak_activations_per_rank == (expected,) * P, (P, M)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_fb_overlap_shortens_the_step(spec: ScheduleSpec, P: int) -> None:
    M = 4 * P
    assert sim(spec, P, M, fb_overlap=0.5).makespan < sim(spec, P, M).makespan


def test_mirror_keeps_two_copies_of_each_chunk_on_mirror_ranks() -> None:
    for P in (2, 4, 8):
        pl = DUALPIPE.placement(P)
        assert pl.param_copies == 2 and pl.num_chunks == P
        for c in range(P):
            holders = sorted(pl.rank_of(s) for s in range(pl.num_stages) if pl.chunk_of(s) == c)
            assert holders == sorted([c, P - 1 - c])  # P even: never the same rank
        for r in range(P):
            assert pl.stages_of(r) == (r, 2 * P - 1 - r)


def test_dualpipe_directions() -> None:
    P, M = 4, 12
    schedule = DUALPIPE.build(P, M)
    pl = schedule.placement
    first_f = {
        a.microbatch: (a.stage, r)
        for r in range(P)
        for a in schedule.actions(r)
        if a.op is Op.F and pl.prev_stage(a.stage) is None
    }
    # Half the microbatches enter at rank 0 (stage 0), the rest at rank P-1 (stage P).
    assert all(first_f[m] == (0, 0) for m in range(M // 2))
    assert all(first_f[m] == (P, P - 1) for m in range(M // 2, M))


def test_dualpipev_matches_reference_figure() -> None:
    # Device rows of images/dualpipev.png in deepseek-ai/DualPipe (4 ranks, 10 microbatches),
    # read off the figure: stage r is a device's first V leg, 2P-1-r its second.
    expected = {
        0: "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 0F7&7BW3 "
        "7F4&0BW0 0F8&7BW4 7F5&0BW1 0F9&7BW5 7F6&0BW2 7BW6 7F7&0BW3 7BW7 7F8&0BW4 7BW8 "
        "7F9&0BW5 7BW9 0B6 0W6 0B7 0W7 0B8 0W8 0B9 0W9",
        3: "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4BW0 4F4&3BW0 3F5&4BW1 4F5&3BW1 3F6&4BW2 "
        "4F6&3BW2 3F7&4BW3 4F7&3BW3 3F8&4BW4 4F8&3BW4 3F9&4BW5 4F9&3BW5 4BW6 3BW6 4BW7 "
        "3BW7 4B8 3B8 4B9 3B9 4W8 3W8 4W9 3W9",
    }
    schedule = DUALPIPEV.build(4, 10)
    for r, text in expected.items():
        assert " ".join(str(s) for s in schedule.steps[r]) == text


@pytest.mark.parametrize(
    ("spec", "P", "M", "knob"),
    [
        (DUALPIPE, 3, 12, "pipeline.degree"),
        (DUALPIPE, 5, 20, "pipeline.degree"),
        (DUALPIPE, 4, 9, "pipeline.microbatches"),
        (DUALPIPE, 4, 6, "pipeline.microbatches"),
        (DUALPIPE, 8, 14, "pipeline.microbatches"),
        (DUALPIPE, 0, 4, "pipeline.degree"),
        (DUALPIPEV, 4, 7, "pipeline.microbatches"),
        (DUALPIPEV, 2, 3, "pipeline.microbatches"),
        (DUALPIPEV, 0, 4, "pipeline.degree"),
    ],
)
def test_constraints_name_the_knob(spec: ScheduleSpec, P: int, M: int, knob: str) -> None:
    with pytest.raises(ValueError, match=knob) as info:
        spec.build(P, M)
    assert "\n" not in str(info.value)
    assert not spec.is_valid(P, M)


def test_constraint_edges_are_valid() -> None:
    assert DUALPIPE.is_valid(4, 8) and DUALPIPEV.is_valid(4, 8) and DUALPIPEV.is_valid(4, 9)
