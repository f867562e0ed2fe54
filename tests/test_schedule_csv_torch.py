"""schedule.csv speaks torch.distributed.pipelining's action names: torch's own CSV loader
(`PipelineScheduleMulti._load_csv`, which parses with `_Action.from_str` and checks the
schedule with `_validate_schedule`) reads what pipetrain writes and gets the same actions back.
pipetrain still reads its own older form (B = input gradient, BW, `&` pairs)."""

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _ComputationType

from pipetrain.schedules import registry
from pipetrain.schedules.ir import Action, Op, Overlap, Reduce, Schedule, torch_cell
from pipetrain.schedules.reduce import add_reduces
from pipetrain.schedules.validate import validate

pytestmark = pytest.mark.pure

TORCH_OP = {Op.F: _ComputationType.FORWARD, Op.B: _ComputationType.BACKWARD_INPUT,
            Op.W: _ComputationType.BACKWARD_WEIGHT, Op.BW: _ComputationType.FULL_BACKWARD}


def as_torch(cell) -> _Action:
    """What the cell means, built from torch's own types (not from its text)."""
    if isinstance(cell, Overlap):
        return _Action(-1, _ComputationType.OVERLAP_F_B, None, (as_torch(cell.forward), as_torch(cell.backward)))
    if isinstance(cell, Reduce):
        return _Action(cell.stage, _ComputationType.REDUCE_GRAD, None)
    assert isinstance(cell, Action)
    return _Action(cell.stage, TORCH_OP[cell.op], cell.microbatch)


def torch_loads(path, schedule: Schedule) -> dict[int, list[_Action]]:
    """torch's loader on a real PipelineScheduleMulti; its __init__ wants live stages and a
    process group, none of which `_load_csv` reads, so only the fields it reads are set."""
    torch_sched = object.__new__(PipelineScheduleMulti)
    torch_sched.pipeline_order = {}
    torch_sched.pp_group_size = schedule.num_ranks
    torch_sched._num_stages = schedule.placement.num_stages
    torch_sched._n_microbatches = schedule.num_microbatches
    torch_sched._stages = []
    torch_sched._load_csv(str(path))
    mapping = torch_sched.stage_index_to_group_rank
    assert mapping == {s: schedule.placement.rank_of(s) for s in range(schedule.placement.num_stages)}
    return torch_sched.pipeline_order


# every built-in schedule but DualPipe: its mirror runs M/2 microbatches through each stage,
# which torch's schedule format cannot say (its validator wants all M on every stage)
EXPRESSIBLE = [(n, 4, 8, 2 if n in ("interleaved_1f1b", "looped_bfs") else registry.get(n).fixed_stages_per_rank or 1)
               for n in registry.names() if n != "dualpipe"]


@pytest.mark.parametrize("name,P,M,v", EXPRESSIBLE, ids=[c[0] for c in EXPRESSIBLE])
def test_torch_loads_the_written_csv_with_the_same_actions(tmp_path, name, P, M, v):
    schedule = registry.build(name, P, M, v)
    path = tmp_path / "schedule.csv"
    path.write_text(schedule.to_csv())
    order = torch_loads(path, schedule)
    assert order == {r: [as_torch(c) for c in schedule.cells(r)] for r in range(P)}
    back = Schedule.from_csv(path.read_text(), name=name, placement=schedule.placement, num_microbatches=M)
    assert back == schedule


def test_reductions_and_dualpipe_pairs_parse_in_torch():
    """REDUCE_GRAD marks load in torch too; DualPipe's cells (pairs included) parse to the same actions."""
    schedule = add_reduces(registry.build("zbv", 2, 4, 2))
    for sched in (schedule, registry.build("dualpipe", 4, 8, 2)):
        for r in range(sched.num_ranks):
            cells = sched.cells(r)
            assert ([_Action.from_str(t) for t in sched.to_csv().splitlines()[r].split(",")]
                    == [as_torch(c) for c in cells])
    assert any(isinstance(c, Reduce) for c in schedule.cells(0))
    pairs = [c for r in range(4) for c in registry.build("dualpipe", 4, 8, 2).cells(r) if isinstance(c, Overlap)]
    assert pairs and "OVERLAP_F_B" in registry.build("dualpipe", 4, 8, 2).to_csv()


OURS = "0F0,0F1,0B0,0W0,0F2&0BW1\n1F0,1BW0,1F1,1B1,1W1,1F2,1BW2\n"


def test_pipetrain_form_still_reads_and_is_rewritten_in_torch_names():
    placement = registry.placement_for("custom", 2)
    sched = Schedule.from_csv(OURS, name="custom", placement=placement, num_microbatches=3)
    assert [str(c) for c in sched.cells(0)] == ["0F0", "0F1", "0B0", "0W0", "0F2&0BW1"]
    assert sched.to_csv() == "0F0,0F1,0I0,0W0,(0F2;0B1)OVERLAP_F_B\n1F0,1B0,1F1,1I1,1W1,1F2,1B2\n"
    assert Schedule.from_csv(sched.to_csv(), name="custom", placement=placement, num_microbatches=3) == sched
    # F and B only: a complete schedule only if B is torch's full backward
    fb = Schedule.from_csv("0F0,0B0\n1F0,1B0\n", name="custom", placement=placement, num_microbatches=1)
    validate(fb)
    assert {a.op for r in range(2) for a in fb.actions(r)} == {Op.F, Op.BW}
    with pytest.raises(ValueError, match="mixes pipetrain's names"):
        Schedule.from_csv("0F0,0I0,0W0\n1F0,1BW0\n", name="custom", placement=placement, num_microbatches=1)


# torch.distributed.pipelining's multi-stage schedules whose order is computed per rank in pure
# Python (`_calculate_single_rank_operations`), and the placement style it asks for
TORCH_ORDERS = {"interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"), "looped_bfs": ("ScheduleLoopedBFS", "loop"),
                "zbv": ("ScheduleZBVZeroBubble", "v"), "dualpipev": ("ScheduleDualPipeV", "v")}


def torch_order(name: str, P: int, M: int, v: int) -> dict[int, list[str]]:
    """torch's own per-rank order, as text, without stages or a process group: its __init__ wants
    both, its order generator reads only the fields set here."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls_name, style = TORCH_ORDERS[name]
    obj = object.__new__(getattr(torch_schedules, cls_name))
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = P, v, M
    obj.num_stages = obj._num_stages = P * v
    obj.stage_index_to_group_rank = {s: (s % P if style == "loop" or s < P else 2 * P - 1 - s) for s in range(P * v)}
    obj.rank, obj._stages = 0, [None] * v  # LoopedBFS counts its local stages by len(_stages)
    obj.number_of_rounds = max(1, M // P)  # Interleaved1F1B's rounds, set by its __init__
    obj.microbatches_per_round = M // obj.number_of_rounds
    return {r: [str(a) for a in obj._calculate_single_rank_operations(r) if a is not None] for r in range(P)}


@pytest.mark.parametrize("name", sorted(TORCH_ORDERS))
def test_generators_give_torchs_own_orders(name):
    """Same name, same order: pipetrain's schedules are torch's, action for action (so a speed
    comparison with torch, bench/pipelining_vs_torch.py, compares the runtimes, not the orders)."""
    compared = 0
    for P in (2, 4):
        for M in (P, 2 * P, 3 * P, 4 * P):
            v = registry.get(name).fixed_stages_per_rank or 2
            try:
                ours = registry.build(name, P, M, v)
            except ValueError:
                continue  # a count pipetrain refuses (dualpipev wants M >= 2P)
            theirs = torch_order(name, P, M, v)
            for r in range(P):
                assert [torch_cell(c) for c in ours.steps[r]] == theirs[r], (name, P, M, r)
            compared += 1
    assert compared >= 4
