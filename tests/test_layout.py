"""The parallel layout and its config (pure: no process group): world = pp x dp_replicate x
dp_shard with pp outermost, every rank's coordinates and groups, one-line errors before any
process starts, dp_shard=-1 filling a world a launcher fixed, REDUCE_GRAD placement."""

from __future__ import annotations

import itertools

import pytest

from pipetrain.config.cluster import ClusterConfig
from pipetrain.launch.resolvers import _tasks_per_node
from pipetrain.parallel.layout import Layout
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Op, Reduce, Schedule
from pipetrain.schedules.reduce import ReduceError, add_reduces, check_reduces
from pipetrain.schedules.validate import ScheduleError, validate

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 1, 2, 1, 1), (2, 2, 1, 1, 1), (4, 2, 2, 1, 1),
                                   (3, 1, 4, 1, 1), (2, 1, 1, 1, 2), (2, 1, 2, 1, 2), (2, 2, 2, 1, 2),
                                   (1, 1, 1, 1, 4), (2, 1, 2, 2, 1), (2, 2, 1, 2, 1), (1, 1, 1, 4, 1)])
def test_coordinates_are_the_mesh_order_and_groups_partition_the_world(shape):
    layout = Layout(**dict(zip(("pp", "dp_replicate", "dp_shard", "cp", "tp"), shape)))
    assert layout.shape == shape
    ranks = list(range(layout.world))
    # row-major over ("pp", "dp_replicate", "dp_shard", "cp", "tp"), as init_device_mesh lays the ranks out
    assert all(layout.rank_of(*vars(layout.coords(r)).values()) == r for r in ranks)
    assert [tuple(vars(layout.coords(r)).values()) for r in ranks] == list(itertools.product(*map(range, shape)))
    pipelines = layout.pipelines()
    assert len(pipelines) == layout.dp * layout.cp * layout.tp and sorted(sum(pipelines, [])) == ranks
    for r in ranks:
        c = layout.coords(r)
        mine = layout.pipeline_ranks(r)
        assert mine in pipelines and mine[layout.pp_rank(r)] == r
        assert all(layout.tp_index(g) == c.tp for g in mine)  # tp index i sends to tp index i
        group = layout.dp_ranks(r)  # data and context parallel: every rank holding the same parameters
        assert len(group) == layout.dp * layout.cp and r in group
        assert all(layout.pp_rank(g) == c.pp and layout.tp_index(g) == c.tp for g in group)
        tp_group = layout.tp_ranks(r)
        assert len(tp_group) == layout.tp and r in tp_group and tp_group == list(range(tp_group[0], tp_group[-1] + 1))
        assert {layout.dp_index(g) for g in tp_group} == {layout.dp_index(r)}  # one batch slice per tp group
        cp_group = layout.cp_ranks(r)
        assert len(cp_group) == layout.cp and r in cp_group and set(cp_group) <= set(group)
        assert {layout.dp_index(g) for g in cp_group} == {layout.dp_index(r)}  # cp: positions of the same rows
    # each pipeline takes a different slice of the global batch
    assert sorted({layout.dp_index(p[0]) for p in pipelines}) == list(range(layout.dp))


def test_mode_names():
    assert [Layout(2, *d).dp_mode for d in [(1, 1), (2, 1), (1, 2), (2, 2)]] == ["none", "replicate", "shard", "hsdp"]


def test_world_and_microbatch_from_the_config(compose):
    cfg = compose(["pipeline.degree=2", "parallel.dp_replicate=2", "parallel.dp_shard=2", "data.batch_size=32"])
    assert cfg.layout == Layout(2, 2, 2) and cfg.layout.world == 8
    assert cfg.microbatch_size == 32 // (4 * 8)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.dp_replicate=2", "data.batch_size=8"], ["data.batch_size=8", "multiple of 16"]),
    (["parallel.dp_shard=-1"], ["parallel.dp_shard=-1", "cluster=local", "set parallel.dp_shard"]),
    (["parallel.dp_shard=0"], ["parallel.dp_shard must be >= 1"]),
    (["parallel.dp_replicate=0"], ["parallel.dp_replicate must be >= 1"]),
    (["parallel.param_dtype=bfloat16"], ["parallel.param_dtype", "dp_shard > 1"]),
    (["parallel.reduce_dtype=bfloat16"], ["parallel.reduce_dtype", "does nothing"]),
    (["parallel.overlap_reduce=false"], ["parallel.overlap_reduce=false", "does nothing"]),
    (["parallel.dp_replicate=2", "data.batch_size=16", "cluster.dp_bandwidth_gbs=0"],
     ["cluster.dp_bandwidth_gbs must be > 0"]),
    (["parallel.reduce_dtype=float16", "parallel.dp_shard=2"], ["parallel.reduce_dtype", "float32, bfloat16"]),
    (["cluster=slurm", "cluster.nodes=2", "cluster.ranks_per_node=1", "parallel.dp_replicate=2"],
     ["cluster.nodes=2 x cluster.ranks_per_node=1", "the world of 4 ranks"]),
])
def test_bad_layouts_are_one_line_before_any_process(compose, overrides, words):
    from omegaconf.errors import OmegaConfBaseException

    with pytest.raises((ValueError, OmegaConfBaseException)) as info:
        compose(overrides)
    err = info.value
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err)
    assert all(w in text for w in words), text
    assert "\n" not in text


def test_dp_shard_fills_the_world_a_launcher_fixed(compose, monkeypatch):
    cfg = compose(["cluster=slurm", "cluster.nodes=2", "cluster.ranks_per_node=4", "parallel.dp_shard=-1",
                   "data.batch_size=32"])
    assert cfg.layout == Layout(2, 1, 4)
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert compose(["cluster=torchrun", "parallel.dp_shard=-1", "data.batch_size=24"]).layout == Layout(2, 1, 3)
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(Exception, match="not a multiple of pipeline.degree=2"):
        compose(["cluster=torchrun", "parallel.dp_shard=-1"])


def test_slurm_tasks_per_node_count_the_whole_world():
    assert _tasks_per_node(2, 2, None, 2, 2) == 4  # 8 ranks on 2 nodes
    assert _tasks_per_node(2, 1, 8, 1, -1) == 8
    with pytest.raises(ValueError, match="set cluster.ranks_per_node"):
        _tasks_per_node(2, 2, None, 1, -1)
    assert ClusterConfig(name="slurm", nodes=2, ranks_per_node=4).fixed_world() == 8
    assert ClusterConfig(name="local").fixed_world() is None


@pytest.mark.parametrize("name, P, M, v", [("1f1b", 4, 8, 1), ("zbh1", 4, 8, 1), ("zbv", 4, 8, 2),
                                           ("dualpipev", 4, 8, 2), ("dualpipe", 4, 8, 2),
                                           ("interleaved_1f1b", 4, 8, 2), ("gpipe", 2, 4, 1)])
def test_one_reduce_per_stage_right_after_its_last_weight_gradient(name, P, M, v):
    schedule = add_reduces(registry.build(name, P, M, v))
    validate(schedule)
    for r in range(P):
        actions = list(schedule.actions(r))
        marks = schedule.reduces[r]
        assert sorted(m.stage for _, m in marks) == sorted(schedule.placement.stages_of(r))
        for boundary, mark in marks:
            done = [a for a in actions[:boundary] if a.stage == mark.stage and a.op in (Op.W, Op.BW)]
            later = [a for a in actions[boundary:] if a.stage == mark.stage and a.op in (Op.W, Op.BW)]
            forwards = [a for a in actions if a.stage == mark.stage and a.op is Op.F]
            assert len(done) == len(forwards) and not later  # every weight gradient before, none after
            # right after: the action before the mark is that stage's last weight gradient
            assert actions[boundary - 1].stage == mark.stage or any(
                actions[boundary - 1].stage == m.stage for b, m in marks if b == boundary)
    # round trip through the CSV a user edits (torch's REDUCE_GRAD spelling)
    text = schedule.to_csv()
    assert f"{schedule.placement.stages_of(0)[0]}REDUCE_GRAD" in text
    assert Schedule.from_csv(text, name=name, placement=schedule.placement, num_microbatches=M) == schedule


def test_hand_written_reductions_are_checked():
    base = registry.build("1f1b", 2, 4, 1)
    good = add_reduces(base)
    check_reduces(good)
    early = good.__class__(base.name, base.placement, 4, base.steps, reduces=((good.reduces[0][0].__class__(
        (2, Reduce(0))),), good.reduces[1]))
    with pytest.raises(ReduceError, match="before stage 0's last weight gradient"):
        check_reduces(early)
    with pytest.raises(ScheduleError, match="before stage 0's last weight gradient"):
        validate(early)
    twice = good.__class__(base.name, base.placement, 4, base.steps,
                           reduces=(good.reduces[0] * 2, good.reduces[1]))
    with pytest.raises(ReduceError, match="twice"):
        check_reduces(twice)
    missing = good.__class__(base.name, base.placement, 4, base.steps, reduces=((), good.reduces[1]))
    with pytest.raises(ReduceError, match="never reduces stage 0"):
        check_reduces(missing)
    foreign = good.__class__(base.name, base.placement, 4, base.steps,
                             reduces=(((8, Reduce(1)),), good.reduces[1]))
    with pytest.raises(ReduceError, match="holds stages 0"):
        check_reduces(foreign)
