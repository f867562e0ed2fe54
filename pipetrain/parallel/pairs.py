"""A process group per pair of pipeline ranks that exchange tensors (pipeline.p2p_transport=pair_groups).

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
from typing import Optional, Sequence

import torch
import torch.distributed as dist


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
