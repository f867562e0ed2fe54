"""Expert parallel on the one layout (parallel/layout.py, mesh.py): ep borrows dp_shard's ranks here
(tests/test_fold_layout.py: over cp and tp too).
Pure checks of which ranks exchange tokens and which hold the same experts, the one-line refusals,
and the groups the mesh builds on 8 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.parallel.layout import Layout


@pytest.mark.pure
def test_ep_groups_tile_the_world_and_experts_are_held_by_dp_over_ep_ranks():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=4, ep=2)
    assert layout.world == 16  # ep borrows: the world is unchanged
    groups = {tuple(layout.ep_ranks(r)) for r in range(layout.world)}
    assert sorted(r for g in groups for r in g) == list(range(16))
    for r in range(layout.world):
        c, ep, edp = layout.coords(r), layout.ep_ranks(r), layout.edp_ranks(r)
        assert r in ep and r in edp and len(ep) == 2 and len(edp) == layout.dp // layout.ep
        assert {(layout.coords(q).pp, layout.coords(q).dp_replicate, layout.coords(q).dp_shard // 2) for q in ep} \
            == {(c.pp, c.dp_replicate, c.dp_shard // 2)}  # one pipeline stage, consecutive dp_shard indices
        assert {(layout.coords(q).pp, layout.ep_index(q)) for q in edp} == {(c.pp, layout.ep_index(r))}
        assert set(edp) <= set(layout.dp_ranks(r)) and set(ep) <= set(layout.dp_ranks(r))
    assert layout.describe() == "pp=2 x dp_replicate=2 x dp_shard=4 = 16 ranks (experts: ep=2 x edp=4)"


@pytest.mark.pure
@pytest.mark.parametrize("kw, message", [
    (dict(dp_shard=3, ep=2), r"parallel.ep=2 borrows ranks of parallel.dp_shard x cp \(dp_shard=3 = 3\)"),
    (dict(dp_shard=2, tp=4, ep=2, etp=1), "ep borrows tp's ranks whole"),
])
def test_a_bad_ep_layout_is_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kw)


@pytest.mark.pure
@pytest.mark.parametrize("overrides, message", [
    (["model=llama-tiny", "parallel.dp_shard=2", "parallel.ep=2"], "model=llama-tiny has none: set parallel.ep=1"),
    (["model=llama-tiny", "parallel.ep=0"], "parallel.ep must be >= 1"),
])
def test_the_config_refuses_ep_before_any_rank_starts(compose, overrides, message):
    with pytest.raises(Exception, match=message):
        compose(overrides)


def groups_rank(rank: int, world: int, out, layout: Layout) -> None:
    """Each group's members as the built mesh has them, and the experts' and FSDP2's meshes' ranks."""
    import torch.distributed as dist

    from pipetrain.parallel.mesh import build_groups

    g = build_groups(layout, "cpu")
    seen = {}
    for name in ("ep_group", "edp_group", "batch_group"):
        members = [None] * dist.get_world_size(getattr(g, name))
        dist.all_gather_object(members, rank, group=getattr(g, name))
        seen[name] = members
    seen["experts_mesh"] = g.experts_mesh.mesh.flatten().tolist()
    seen["fsdp_mesh"] = g.fsdp_mesh.mesh.flatten().tolist()
    torch.save(seen, out / f"rank{rank}.pt")


@pytest.mark.dist
def test_the_mesh_builds_the_ep_and_expert_data_parallel_groups(tmp_path):
    spawn(groups_rank, 8, tmp_path, Layout(pp=2, dp_shard=4, ep=2))
    layout = Layout(pp=2, dp_shard=4, ep=2)
    for r in range(8):
        seen = torch.load(tmp_path / f"rank{r}.pt")
        assert seen["ep_group"] == layout.ep_ranks(r)
        assert seen["edp_group"] == layout.edp_ranks(r) == seen["experts_mesh"]
