"""MoE parallel folding on the one layout (parallel/layout.py): the experts' mesh (pp, dp_replicate, edp,
ep, etp) read over the same ranks as the dense one (pp, dp_replicate, dp_shard, cp, tp). Pure checks of
the arithmetic and the one-line refusals, and the groups the mesh builds on 4 real gloo ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from _dist import spawn
from test_ep_layout import groups_rank
from pipetrain.parallel.layout import Layout, fold_error


def foldings():
    """Every layout of up to 16 ranks whose experts fold (each degree 1, 2 or 4)."""
    for ds, cp, tp, dr, ep in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2), (1, 2, 4)):
        for etp in sorted({1, tp}):
            if ds * cp * tp * dr <= 16 and not fold_error(dp_shard=ds, cp=cp, tp=tp, ep=ep, etp=etp):
                yield Layout(pp=2, dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp, ep=ep, etp=etp)


@pytest.mark.pure
def test_every_folding_tiles_the_world_and_keeps_an_ep_group_on_one_stage():
    seen = 0
    for layout in foldings():
        seen += 1
        ep_groups = {tuple(layout.ep_ranks(r)) for r in range(layout.world)}
        edp_groups = {tuple(layout.edp_ranks(r)) for r in range(layout.world)}
        for groups, size in ((ep_groups, layout.ep), (edp_groups, layout.edp * layout.dp_replicate)):
            assert sorted(r for g in groups for r in g) == list(range(layout.world)), layout
            assert {len(g) for g in groups} == {size}, layout
        for r in range(layout.world):
            c = layout.coords(r)
            ep = [layout.coords(q) for q in layout.ep_ranks(r)]
            assert {q.pp for q in ep} == {c.pp}, layout  # one stage: the same sequence of MoE layers
            assert [layout.ep_index(q) for q in layout.ep_ranks(r)] == list(range(layout.ep))
            if layout.etp == layout.tp:  # experts tensor-split: an EP group keeps one tp index (its slice)
                assert {q.tp for q in ep} == {c.tp} and layout.etp_index(r) == c.tp, layout
            else:  # experts whole: ep takes whole tp groups (they hold the same tokens)
                assert {q.tp for q in ep} == set(range(layout.tp)), layout
            # the same experts (and slice) on every rank of the edp group, on the same stage
            edp = layout.edp_ranks(r)
            assert {(layout.coords(q).pp, layout.ep_index(q), layout.etp_index(q)) for q in edp} \
                == {(c.pp, layout.ep_index(r), layout.etp_index(r))}
    assert seen > 40


@pytest.mark.pure
def test_ep_borrows_cp_first_then_dp_shard():
    """torchtitan's order: pp2 x cp2 x ep2 is 4 ranks, ep over the cp ranks; at dp_shard2 x cp2, ep=2 takes cp
    and edp is dp_shard, ep=4 takes both."""
    layout = Layout(pp=2, cp=2, ep=2)
    assert layout.world == 4 and layout.ep_ranks(0) == layout.cp_ranks(0) == [0, 1] and layout.edp == 1
    layout = Layout(dp_shard=2, cp=2, ep=2)
    assert layout.ep_ranks(0) == layout.cp_ranks(0) == [0, 1] and layout.edp_ranks(0) == [0, 2]
    layout = Layout(dp_shard=2, cp=2, ep=4)
    assert layout.ep_ranks(3) == [0, 1, 2, 3] and layout.edp_ranks(3) == [3]
    assert layout.describe() == "pp=1 x dp_shard=2 x cp=2 = 4 ranks (experts: ep=4 x edp=1)"
    layout = Layout(pp=2, tp=2, ep=2, etp=1)  # experts whole: ep over tp
    assert layout.ep_ranks(2) == layout.tp_ranks(2) == [2, 3]
    assert Layout(cp=2, tp=2, ep=4, etp=1).ep_ranks(0) == [0, 1, 2, 3]  # over cp x tp
    layout = Layout(dp_shard=2, tp=2, ep=2)  # etp = tp: ep over dp_shard, one tp index per EP group
    assert layout.etp == 2 and layout.ep_ranks(1) == [1, 3] and layout.edp == 1


@pytest.mark.pure
@pytest.mark.parametrize("kw, message", [
    (dict(tp=4, ep=2, etp=2), "parallel.etp=2 must be 1 .* or parallel.tp=4 .*a part of tp splitting the experts"),
    (dict(tp=4, ep=2, etp=1), "ep borrows tp's ranks whole .* parallel.ep=2 must be a multiple of 4"),
    (dict(dp_shard=2, cp=2, ep=8), r"parallel.ep=8 borrows ranks of parallel.dp_shard x cp \(dp_shard=2 x cp=2 = 4\)"),
    (dict(cp=2, tp=2, ep=8, etp=1), r"dp_shard x cp x tp \(cp=2 x tp=2 = 4\): set parallel.ep to a divisor of 4"),
])
def test_a_folding_that_does_not_fit_is_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kw)


@pytest.mark.pure
@pytest.mark.parametrize("overrides, message", [
    (["model=llama-tiny", "parallel.cp=2", "parallel.etp=1"], "model=llama-tiny has none"),
    (["model=moe-tiny", "parallel.cp=2", "parallel.ep=8"], r"parallel.ep=8 borrows ranks of .*divisor of 2"),
    (["model=moe-tiny", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel with an MoE model"),
    (["model=moe-tiny", "model.num_key_value_heads=4", "parallel.tp=4", "parallel.dp_shard=2", "parallel.ep=2",
      "parallel.etp=1"], "parallel.ep=2 must be a multiple of 4"),
    (["model=moe-tiny", "parallel.etp=0"], "parallel.etp must be >= 1"),
])
def test_the_config_refuses_a_folding_before_any_rank_starts(compose, overrides, message):
    with pytest.raises(Exception, match=message):
        compose(overrides)


@pytest.mark.pure
def test_the_issue_command_is_four_ranks(compose):
    config = compose(["model=moe-tiny", "data.seq_len=2048", "parallel.cp=2", "parallel.ep=2", "pipeline.degree=2"])
    assert config.layout.world == 4 and config.layout.ep_ranks(0) == config.layout.cp_ranks(0)


@pytest.mark.dist
@pytest.mark.slow
def test_one_world_mesh_builds_the_dense_and_the_experts_groups(tmp_path):
    layout = Layout(dp_shard=2, cp=2, ep=2)
    spawn(groups_rank, 4, tmp_path, layout)
    for r in range(4):
        seen = torch.load(tmp_path / f"rank{r}.pt")
        assert seen["ep_group"] == layout.ep_ranks(r) == layout.cp_ranks(r)
        assert seen["edp_group"] == layout.edp_ranks(r) == seen["experts_mesh"]
        assert seen["batch_group"] == seen["fsdp_mesh"] == [0, 1, 2, 3]  # dp x cp
