"""The one DeviceMesh of a run, built from its Layout, and what a rank takes from it.

One mesh over the world, `init_device_mesh(device, (world,), ("world",))`, read two ways (torchtitan's
ParallelDims): the dense view `("pp", "dp_replicate", "dp_shard", "cp", "tp")` and, under expert
parallel, the experts' view `("pp", "dp_replicate", "edp", "ep", "etp")` of the same ranks (layout.py:
the folding), both `_unflatten`s of the world dim. Building them is collective: every rank of the
world does it, in the same order, before anything else creates a process group. A rank then reads
its pipeline group (pp: point-to-point between stages), its data-parallel group (the ranks that
hold its stages and its tp shard), its tensor-parallel group (the ranks its stages' layers are
split across), its batch group (dp x cp: the ranks with other tokens of the same stages), under
expert parallel its EP and expert-data-parallel groups (the experts' view) and, for FSDP2, the
sub-mesh its stages are sharded (and replicated) over.

Pair groups (`build_pair_groups`, at the end): a process group per pair of pipeline ranks that
exchange tensors (pipeline.p2p_transport=pair_groups).

Why: ProcessGroupNCCL runs every `batch_isend_irecv` of one process group on that group's one
communicator and stream, in issue order, so on the pipeline's single group a rank's send to one
neighbour queues behind a receive from the other, and some plans deadlock (review F1). A 2-rank
group per pair gives each pair its own communicator and stream: exactly the rule the plan is
proven against (schedules/p2p_check.py, streams="pair").

`new_group` must be called by every rank of the world, in the same order, whether or not it is a
member; so every rank creates the groups of every pair of every pipeline (under data and tensor
parallel there are many pipelines), in one sorted order of global rank pairs. Each group is then
initialised eagerly, so no pair's first P2P creates a communicator lazily: one 1-element
all_reduce per group, done by its two members in the same sorted order. Like taking locks in one
global order this cannot deadlock: the smallest pair not yet initialised has both members waiting
on it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetrain.compat import flatten_mesh, unflatten_mesh
from pipetrain.parallel.layout import DIMS, EXPERT_DIMS, Coords, Layout


@dataclass
class RankGroups:
    layout: Layout
    rank: int  # global rank
    mesh: Optional[DeviceMesh]  # None: a single process without a process group
    pp_group: Optional[dist.ProcessGroup]  # this rank's pipeline (None: the default group / no group)
    pipeline_ranks: list[int]  # global ranks of this rank's pipeline, by pipeline rank
    dp_group: Optional[dist.ProcessGroup]  # ranks holding the same stages (None when dp = 1)
    tp_group: Optional[dist.ProcessGroup] = None  # ranks splitting this rank's layers (None when tp = 1)
    ep_group: Optional[dist.ProcessGroup] = None  # ranks splitting this rank's experts (None when ep = 1)
    edp_group: Optional[dist.ProcessGroup] = None  # ranks holding this rank's experts (None when only it does)
    experts_mesh: Optional[DeviceMesh] = None  # what FSDP2 shards experts over: ("dp_replicate",) "edp_shard"
    cp_group: Optional[dist.ProcessGroup] = None  # ranks splitting this rank's sequences (None when cp = 1)
    # The mesh FSDP2 shards a stage over: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP; under
    # context parallel dp_shard x cp flattened in place of dp_shard (torchtitan's "dp_shard_cp").
    fsdp_mesh: Optional[DeviceMesh] = None
    batch_group: Optional[dist.ProcessGroup] = None  # dp x cp: the ranks with other tokens of these stages

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank(self.rank)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def dp_index(self) -> int:
        return self.layout.dp_index(self.rank)

    @property
    def tp_index(self) -> int:
        return self.layout.tp_index(self.rank)

    def step_groups(self) -> list[dist.ProcessGroup]:
        """Every group of the mesh this rank is in, and its pipeline, data and tensor parallel groups
        (a flattened dp group is not among the mesh's own): what a training step communicates over."""
        mine = list(self.mesh.get_all_groups()) if self.mesh is not None else []
        return [g for g in (*mine, self.pp_group, self.dp_group, self.tp_group, self.ep_group, self.edp_group,
                            self.batch_group) if g is not None]

    @property
    def ep_index(self) -> int:
        return self.layout.ep_index(self.rank)

    @property
    def cp_index(self) -> int:
        return self.layout.cp_index(self.rank)


def build_groups(layout: Layout, device_type: str) -> RankGroups:
    """Collective over the world (when a process group exists): the mesh and this rank's groups."""
    if not dist.is_initialized():
        if layout.world != 1:
            raise ValueError(f"a layout of {layout.world} ranks needs a process group")
        return RankGroups(layout, 0, None, None, [0], None)
    if dist.get_world_size() != layout.world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the layout needs {layout.world}")
    rank = dist.get_rank()
    if layout.world == layout.pp:  # exactly as before data parallel: the pipeline is the default group
        return RankGroups(layout, rank, None, None, list(range(layout.world)), None)
    world = init_device_mesh(device_type, (layout.world,), mesh_dim_names=("world",))
    mesh = unflatten_mesh(world, "world", layout.shape, DIMS)
    pp_group = mesh["pp"].get_group()
    dp_group = _group(mesh, layout, ("dp_replicate", "dp_shard"), "dp")
    tp_group = mesh["tp"].get_group() if layout.tp > 1 else None
    cp_group = mesh["cp"].get_group() if layout.cp > 1 else None
    fsdp_mesh = _fsdp_mesh(world, mesh, layout)
    batch_group = cp_group if layout.dp == 1 else _group(mesh, layout, ("dp_replicate", "dp_shard", "cp"), "batch")
    ep_group = edp_group = experts_mesh = None
    if layout.ep > 1:  # the experts' view of the same ranks: (pp, dp_replicate, edp, ep, etp), row-major
        experts = unflatten_mesh(world, "world", layout.expert_shape, EXPERT_DIMS)
        ep_group = experts["ep"].get_group()
        experts_mesh = experts["dp_replicate", "edp"] if layout.dp_replicate > 1 else experts["edp"]
        sizes = {"dp_replicate": layout.dp_replicate, "edp": layout.edp}
        edp_group = _group(experts, sizes, ("dp_replicate", "edp"), "edp_all")
    return RankGroups(layout, rank, mesh, pp_group, layout.pipeline_ranks(rank), dp_group, tp_group,
                      ep_group, edp_group, experts_mesh, cp_group, fsdp_mesh, batch_group)


def _group(mesh: DeviceMesh, sizes: object, dims: Sequence[str], name: str) -> Optional[dist.ProcessGroup]:
    """The group over `dims` of `mesh` (their degrees read from `sizes`, a Layout or a dict), flattened
    when several are above 1; None when none is."""
    split = [d for d in dims if (sizes[d] if isinstance(sizes, dict) else getattr(sizes, d)) > 1]
    if not split:
        return None
    return mesh[split[0]].get_group() if len(split) == 1 else flatten_mesh(mesh, split, name).get_group()


def _fsdp_mesh(world: DeviceMesh, mesh: DeviceMesh, layout: Layout) -> Optional[DeviceMesh]:
    """FSDP2's mesh: the shard dims (dp_shard, cp; one dim of the world when both split, torchtitan's
    "dp_shard_cp") after dp_replicate (HSDP)."""
    shard = [d for d in ("dp_shard", "cp") if getattr(layout, d) > 1]
    if not shard:
        return None
    if len(shard) == 2:
        shape = (layout.pp, layout.dp_replicate, layout.dp_shard * layout.cp, layout.tp)
        mesh, shard = unflatten_mesh(world, "world", shape, ("pp", "dp_replicate", "dp_shard_cp", "tp")), \
            ["dp_shard_cp"]
    return mesh["dp_replicate", shard[0]] if layout.dp_replicate > 1 else mesh[shard[0]]


# ---- pair groups (pipeline.p2p_transport=pair_groups) ------------------------------------------

def global_pairs(pairs: Sequence[tuple[int, int]], pipelines: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Every pipeline's pairs as global ranks (a < b), sorted: the one order every rank creates them in."""
    return sorted({(min(pipe[a], pipe[b]), max(pipe[a], pipe[b])) for pipe in pipelines for a, b in pairs})


def build_pair_groups(
    pairs: Sequence[tuple[int, int]],
    pipelines: Sequence[Sequence[int]],
    *,
    rank: int,
    device: torch.device,
    timeout_s: Optional[float] = None,
) -> dict[int, dist.ProcessGroup]:
    """Collective over the world: every rank must call it with the same arguments.

    `pairs`: pipeline-rank pairs that exchange tensors (schedules/p2p.py: exchange_pairs);
    `pipelines`: every pipeline's global ranks, by pipeline rank; `rank`: this process's global
    rank. `timeout_s` is each group's timeout (on NCCL the watchdog then ends a hung P2P; gloo's
    waits are timed by the transport itself). Returns this rank's groups by peer global rank.
    """
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    mine: dict[int, dist.ProcessGroup] = {}
    for a, b in global_pairs(pairs, pipelines):
        kwargs = {} if timeout is None else {"timeout": timeout}
        group = dist.new_group([a, b], **kwargs)  # every rank, members or not, in the same order
        if rank in (a, b):
            mine[b if rank == a else a] = group
    one = torch.zeros(1, device=device)
    for peer in sorted(mine):  # global sorted order again, restricted to this rank's pairs
        dist.all_reduce(one, group=mine[peer])
    return mine
