"""After the first step a collective waits on a peer no longer than pipeline.p2p_timeout_s
(parallel/timeouts.py), on real gloo groups."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import spawn


def stuck_peer(rank: int, world: int, out: Path) -> None:
    from pipetrain.parallel.timeouts import bound_waits

    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=pair)  # before: the long timeout of the group's making
    assert bound_waits([pair, None, pair], 1.0) == 2  # the world's and the pair's, each once, None skipped
    if rank == 1:
        time.sleep(4)  # stuck past the bound (rank 0 waits twice)
        return
    for group in (pair, None):
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.all_reduce(torch.ones(1), group=group)
        waited = time.monotonic() - began
        assert waited < 3.0, waited  # the bound, not the group's 300 s
    (out / "ok0").touch()


@pytest.mark.slow  # 4-5 s on 2 quiet cores, about 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.dist
def test_a_collective_waits_on_a_stuck_peer_no_longer_than_the_bound(tmp_path):
    spawn(stuck_peer, 2, tmp_path)
    assert (tmp_path / "ok0").exists()
