"""Schedule IR: text forms parse back, bad text and bad schedules fail with the grid."""

import pytest

from pipetrain.schedules.ir import Action, Op, Overlap, Schedule, parse_step
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.validate import ScheduleError, validate

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("text", ["0F3", "12B7", "5W0", "2BW10", "0F6&7BW2", "3F1&4B0"])
def test_step_text_round_trip(text):
    assert str(parse_step(text)) == text


@pytest.mark.parametrize("text", ["F3", "0X3", "0F", "0F1&", "0F1&1F2", "0BW1&1F0", "0F1&1BW2&2BW3"])
def test_bad_step_text_is_rejected(text):
    with pytest.raises(ValueError):
        parse_step(text)


def test_overlap_parts():
    step = parse_step("0F6&7BW2")
    assert isinstance(step, Overlap)
    assert step.parts() == (Action(Op.F, 0, 6), Action(Op.BW, 7, 2))


def one_f_one_b(text: str, M: int) -> Schedule:
    return Schedule.from_text(text, name="hand", placement=Placement.loop(2), num_microbatches=M)


def test_hand_1f1b_simulates_as_published():
    s = one_f_one_b("rank 0: 0F0 0F1 0BW0 0F2 0BW1 0BW2\nrank 1: 1F0 1BW0 1F1 1BW1 1F2 1BW2", 3)
    res = simulate(s, StageCosts.uniform(2, 1, 1, 1))
    assert res.makespan == 12  # (M + P - 1)(F + BW)
    assert res.idle_per_rank == (3.0, 3.0)
    assert res.peak_activations_per_rank == (2, 1)


def test_comm_latency_delays_cross_rank_inputs():
    s = one_f_one_b("rank 0: 0F0 0BW0\nrank 1: 1F0 1BW0", 1)
    assert simulate(s, comm_ms=0.5).makespan == pytest.approx(6 + 2 * 0.5)


@pytest.mark.parametrize(
    "text, M, needle",
    [
        ("rank 0: 0F0 0F1 0BW0\nrank 1: 1F0 1BW0 1F1 1BW1", 2, "0B1 or 0BW1 is missing"),
        ("rank 0: 0F0 0BW0 0BW0\nrank 1: 1F0 1BW0", 1, "appears twice"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0 1BW0", 1, "0W0 is missing"),
        ("rank 0: 0F0 0BW0 0W0\nrank 1: 1F0 1BW0", 1, "also a split"),
        ("rank 0: 1F0 0F0 0BW0\nrank 1: 1BW0", 1, "lives on rank 1"),
        ("rank 0: 0F0 0BW0 0BW1 0F1\nrank 1: 1F0 1BW0 1F1 1BW1", 2, "deadlock"),
        ("rank 0: 0F0 0W0 0B0\nrank 1: 1F0 1BW0", 1, "deadlock"),
        ("rank 0: 0F0 0BW0 0F5 0BW5\nrank 1: 1F0 1BW0", 1, "microbatch 5 does not exist"),
    ],
)
def test_validator_names_the_problem_and_prints_the_grid(text, M, needle):
    with pytest.raises(ScheduleError) as info:
        validate(one_f_one_b(text, M))
    msg = str(info.value)
    assert needle in msg
    assert "rank 0" in msg and "rank 1" in msg and ">" in msg  # the grid, with the failing slot marked


def test_mirror_microbatch_must_use_its_chain():
    pl = Placement.mirror(2)  # chain 0: stages 0,1 ; chain 1: stages 2 (rank 1), 3 (rank 0)
    ok = Schedule.from_text(
        "rank 0: 0F0 3F1 3BW1 0BW0\nrank 1: 2F1 1F0 1BW0 2BW1", name="m", placement=pl, num_microbatches=2
    )
    validate(ok)
    wrong = Schedule.from_text(
        "rank 0: 0F1 3F0 3BW0 0BW1\nrank 1: 2F0 1F1 1BW1 2BW0", name="m", placement=pl, num_microbatches=2
    )
    with pytest.raises(ScheduleError, match="chain"):
        validate(wrong)


def test_overlap_pair_costs_with_overlap_factor():
    from pipetrain.schedules import registry

    sched = registry.build("dualpipe", 4, 8, 2)
    costs = StageCosts.uniform(8, 1.0, 2.0, 0.5)
    res = simulate(sched, costs, fb_overlap=0.25)
    pairs = [ts for row in res.timeline for ts in row if isinstance(ts.step, Overlap)]
    assert pairs, "dualpipe has overlapped F&B steps"
    for ts in pairs:
        back = 2.5 if ts.step.backward.op is Op.BW else 2.0
        assert ts.end - ts.start == pytest.approx((1.0 + back) * 0.75)


@pytest.mark.parametrize("text, words", [
    ("rank 0: 0F0 0BW0\nrank one: 1F0 1BW0\n", "line 2: cannot parse schedule line 'rank one: 1F0 1BW0': expected "
                                             "'rank R: 0F0 0F1 ...' with R the rank's number (0, 1, ...)"),
    ("rank 0: 0F0 0BW0\nrank 2: 1F0 1BW0\n", "line 2: schedule lines must list ranks in order 0, 1, ...; got rank 2 "
                                           "where rank 1 was due"),
    ("# two ranks\nrank 0: 0F0 0BW0\nrank 1: 1F0 1Q0\n", "line 3: "),
])
def test_a_bad_text_schedule_file_names_its_line_and_the_format(tmp_path, text, words):
    """A hand-written schedule in the text form (`rank R: ...`): the error names the file, the line and
    what was expected, not Python's `invalid literal for int()` (issue #44)."""
    from pipetrain.schedules.registry import load_custom

    path = tmp_path / "mine.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_custom(path, num_ranks=2, num_microbatches=1)
    assert str(err.value).startswith(f"{path}: {words}") and "\n" not in str(err.value), str(err.value)
