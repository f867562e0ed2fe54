"""After the first step, every wait on a peer is bounded by pipeline.p2p_timeout_s.

The process groups are made with a long timeout (launch/rank.py: 300 s or pipeline.p2p_timeout_s,
whichever is longer): the first step may wait on peers that build, load or compile. Once a step
has run, a collective that waits longer than a point-to-point transfer may is as stuck as one:
a rank SIGSTOPped between its sends and the loss all-reduce left its peers in that all-reduce for
300 s with pipeline.p2p_timeout_s=20. So the groups a step uses (the world's, the mesh's, data
and tensor parallel, the tied weights' subgroups) then take pipeline.p2p_timeout_s, as torchtitan
lowers its groups to comm.train_timeout_seconds after its first step. The checkpoint groups keep
checkpoint.timeout_s (train/checkpoint_group.py): a save may take longer than a step.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch.distributed as dist

from pipetrain.compat import set_group_timeout


def bound_waits(groups: Iterable[Optional[dist.ProcessGroup]], seconds: float) -> int:
    """Give each distinct group (None: skipped) a timeout of `seconds`; with a process group the
    world's too. Returns how many groups were set. Not collective: a timeout is a local setting."""
    if not dist.is_initialized():
        return 0
    done: list[dist.ProcessGroup] = []
    for group in [dist.group.WORLD, *groups]:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or any(group is g for g in done):
            continue
        set_group_timeout(group, seconds)
        done.append(group)
    return len(done)
