"""Loop-placement schedules (gpipe, 1f1b, interleaved_1f1b, looped_bfs): valid over a grid of
(P, M, v), simulated bubble equal to the published one, peak activations, constraints,
and a few orderings worked out by hand."""

from __future__ import annotations

import pytest

from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.loop import SPECS, interleaved_warmup
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.spec import RankCosts, ScheduleSpec
from pipetrain.schedules.validate import validate

pytestmark = pytest.mark.pure

SPEC = {s.name: s for s in SPECS}
RANKS = (1, 2, 4, 8)
# (f, b, w) per stage: the brief's f=b=w, and an uneven split to catch F/BW mix-ups.
COSTS = ((1.0, 1.0, 1.0), (1.0, 2.0, 0.5))


def _vs(spec: ScheduleSpec) -> tuple[int, ...]:
    return (1,) if spec.fixed_stages_per_rank == 1 else (2, 3)


def _rank_costs(v: int, f: float, b: float, w: float) -> RankCosts:
    # one rank's share is v stages
    return RankCosts(F=v * f, B=v * b, W=v * w, FB=v * (f + b + w))


def _expected_valid_ms(name: str, P: int, v: int) -> list[int]:
    every = range(1, 4 * P + 1)
    if name == "interleaved_1f1b":
        return [M for M in every if M % P == 0]
    if name == "looped_bfs" and v > 1:
        return [M for M in every if M >= P]
    return list(every)


def _expected_peak(name: str, P: int, M: int, v: int, r: int) -> int:
    if name == "gpipe":
        return M
    if name == "1f1b":
        return min(P - r, M)
    if name == "interleaved_1f1b":
        # warm-up forwards + the first steady forward (which runs before its backward)
        return min(2 * (P - r - 1) + (v - 1) * P + 1, v * M)
    return v * M  # looped_bfs: every forward before any backward


def test_specs_names_and_order() -> None:
    assert [s.name for s in SPECS] == ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"]
    for s in SPECS:
        assert s.placement_kind == "loop"
        assert s.description and "\n" not in s.description
        assert s.analytic_bubble is not None
    assert SPEC["interleaved_1f1b"].fixed_stages_per_rank is None
    assert SPEC["looped_bfs"].fixed_stages_per_rank is None


@pytest.mark.parametrize("name", [s.name for s in SPECS])
@pytest.mark.parametrize("P", RANKS)
def test_grid_valid_bubble_and_peak(name: str, P: int) -> None:
    spec = SPEC[name]
    for v in _vs(spec):
        valid = [M for M in range(1, 4 * P + 1) if spec.is_valid(P, M, v)]
        assert valid == _expected_valid_ms(name, P, v), (name, P, v)
        for M in valid:
            sched = spec.build(P, M, v)
            assert sched.placement == Placement.loop(P, v)
            validate(sched)
            for f, b, w in COSTS:
                res = simulate(sched, StageCosts.uniform(P * v, f, b, w), comm_ms=0.0)
                want = spec.analytic_bubble(P, v, _rank_costs(v, f, b, w))
                for r, idle in enumerate(res.idle_per_rank):
                    assert idle == pytest.approx(want, abs=1e-9), (name, P, M, v, r, f, b, w)
            peaks = res.peak_activations_per_rank
            assert list(peaks) == [_expected_peak(name, P, M, v, r) for r in range(P)], (name, P, M, v)


def test_one_f_one_b_peak_is_p_minus_r_when_m_at_least_p() -> None:
    for P in RANKS:
        for M in range(P, 4 * P + 1):
            res = simulate(SPEC["1f1b"].build(P, M))
            assert res.peak_activations_per_rank == tuple(P - r for r in range(P))


def test_bubbles_shrink_with_virtual_stages() -> None:
    c = RankCosts(F=1.0, B=1.0, W=1.0, FB=3.0)
    assert SPEC["gpipe"].analytic_bubble(4, 1, c) == 9.0
    assert SPEC["1f1b"].analytic_bubble(4, 1, c) == 9.0
    assert SPEC["interleaved_1f1b"].analytic_bubble(4, 3, c) == 3.0
    assert SPEC["looped_bfs"].analytic_bubble(4, 2, c) == 4.5


# ---- constraints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "P", "M", "v", "knob"),
    [
        ("gpipe", 2, 0, 1, "pipeline.microbatches"),
        ("1f1b", 0, 4, 1, "pipeline.degree"),
        ("1f1b", 2, 0, 1, "pipeline.microbatches"),
        ("interleaved_1f1b", 4, 6, 2, "pipeline.microbatches"),
        ("interleaved_1f1b", 4, 2, 2, "pipeline.microbatches"),
        ("interleaved_1f1b", 4, 8, 1, "schedule.virtual_stages"),
        ("looped_bfs", 4, 3, 2, "pipeline.microbatches"),
        ("looped_bfs", 4, 8, 0, "schedule.virtual_stages"),
    ],
)
def test_constraint_violations_name_the_knob(name: str, P: int, M: int, v: int, knob: str) -> None:
    with pytest.raises(ValueError) as err:
        SPEC[name].build(P, M, v)
    msg = str(err.value)
    assert knob in msg and "\n" not in msg, msg
    assert not SPEC[name].is_valid(P, M, v)


def test_looped_bfs_below_p_is_deadlock_free_but_stalls() -> None:
    # Why check_looped_bfs wants M >= P when v > 1: the generator's order is still valid,
    # but every rank idles (v-1)(P-M) extra stage-slots of forward and of backward.
    gen = SPEC["looped_bfs"].generate
    for P in (2, 4, 8):
        for v in (2, 3):
            for M in range(1, P):
                sched = Schedule.build("looped_bfs", Placement.loop(P, v), M, gen(P, M, v))
                validate(sched)
                res = simulate(sched, StageCosts.uniform(P * v, 1.0, 2.0, 0.5))
                want = (P - 1) * 3.5 + (v - 1) * (P - M) * 3.5
                assert res.idle_per_rank == pytest.approx([want] * P, abs=1e-9)


# ---- orderings checked by hand -------------------------------------------------------------


def _text(name: str, P: int, M: int, v: int = 1) -> list[str]:
    return SPEC[name].build(P, M, v).to_text().splitlines()


def test_gpipe_p2_m2() -> None:
    assert _text("gpipe", 2, 2) == [
        "rank 0: 0F0 0F1 0BW0 0BW1",
        "rank 1: 1F0 1F1 1BW0 1BW1",
    ]


def test_one_f_one_b_p2_m3() -> None:
    # rank 0 warms up with P-1-0 = 1 forward; rank 1 (last) starts 1F1B at once.
    assert _text("1f1b", 2, 3) == [
        "rank 0: 0F0 0F1 0BW0 0F2 0BW1 0BW2",
        "rank 1: 1F0 1BW0 1F1 1BW1 1F2 1BW2",
    ]


def test_one_f_one_b_fewer_microbatches_than_ranks() -> None:
    # M=2 < P=4: warm-up capped at M, so ranks 0 and 1 become fill-drain.
    assert _text("1f1b", 4, 2) == [
        "rank 0: 0F0 0F1 0BW0 0BW1",
        "rank 1: 1F0 1F1 1BW0 1BW1",
        "rank 2: 2F0 2F1 2BW0 2BW1",
        "rank 3: 3F0 3BW0 3F1 3BW1",
    ]


def test_interleaved_p2_v2_m2() -> None:
    # rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 = every forward; rank 1: warm-up 2.
    assert _text("interleaved_1f1b", 2, 2, 2) == [
        "rank 0: 0F0 0F1 2F0 2F1 2BW0 2BW1 0BW0 0BW1",
        "rank 1: 1F0 1F1 3F0 3BW0 3F1 3BW1 1BW0 1BW1",
    ]


def test_interleaved_p4_v2_m8_rank0_matches_megatron_figure() -> None:
    # Narayanan et al. 2021, fig. 4 (device 1, 0-indexed here): microbatches 0-3 through
    # chunk 0, 0-3 through chunk 1, then 4 and 5 (10 warm-up forwards), then 1F1B.
    P, M, v = 4, 8, 2
    assert [interleaved_warmup(P, M, v, r) for r in range(P)] == [10, 8, 6, 4]
    row = _text("interleaved_1f1b", P, M, v)[0].split()[2:]
    assert row[:14] == (
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4BW0 0F7 4BW1".split()
    )
    assert row[-4:] == "0BW4 0BW5 0BW6 0BW7".split()


def test_looped_bfs_p2_v2_m2() -> None:
    assert _text("looped_bfs", 2, 2, 2) == [
        "rank 0: 0F0 0F1 2F0 2F1 2BW1 2BW0 0BW1 0BW0",
        "rank 1: 1F0 1F1 3F0 3F1 3BW1 3BW0 1BW1 1BW0",
    ]
