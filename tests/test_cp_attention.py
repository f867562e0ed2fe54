"""Context-parallel attention (parallel/cp.py) on real gloo ranks: at cp=2 and cp=4, with
grouped-query attention, both ways of reaching the other shards' K and V (allgather, ring) give
each rank the output, dQ, dK and dV full-sequence causal attention gives at its positions; the K/V
each holds at once (CPStats.peak_kv_bytes) is its own block and the gathered whole under allgather,
and under the ring its own block, the one in use and the one in flight (two blocks at cp=2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dist import spawn
from pipetrain.parallel.cp import positions

pytestmark = pytest.mark.dist

B, H, KV, T, D = 2, 4, 2, 32, 8


def full_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (H, KV, KV))
    w = torch.randn(B, H, T, D, generator=g)  # weighs every output element of the loss differently
    return q, k, v, w


def cp_rank(rank: int, world: int, out, how: str) -> None:
    import torch.distributed as dist

    from pipetrain.parallel.cp import CPGroup, CPStats, allgather_attention, ring_attention

    g, stats = CPGroup(dist.group.WORLD, world, rank), CPStats()
    q, k, v, w = full_inputs()
    mine = positions(T, world, rank)
    q, k, v = (t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
    attend = allgather_attention if how == "allgather" else ring_attention
    y = attend(q, k, v, g, T, stats=stats)
    (y * w[:, :, mine]).sum().backward()
    torch.save({"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats.take()},
               out / f"rank{rank}.pt")


def test_positions_balance_the_causal_work_and_tile_the_sequence():
    for cp in (1, 2, 4):
        parts = [positions(T, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(T))
        work = {int(p.sum()) for p in parts}  # keys a rank's queries see, up to a constant per token
        assert len(work) == 1, work
    with pytest.raises(ValueError, match="set data.seq_len to a multiple of 8"):
        positions(36, 4, 0)


@pytest.mark.parametrize("how", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_sequence_attention(tmp_path, cp, how):
    spawn(cp_rank, cp, tmp_path, how)
    q, k, v, w = (t.clone().requires_grad_(True) for t in full_inputs())
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (y * w).sum().backward()
    for rank in range(cp):
        got, mine = torch.load(tmp_path / f"rank{rank}.pt"), positions(T, cp, rank)
        for name, ref in (("y", y.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(got[name], ref[:, :, mine], rtol=1e-5, atol=1e-5, msg=f"{name} rank {rank}")
        # K/V held at once, in blocks of one rank's K and V: allgather its own and the gathered whole;
        # the ring its own, the one in use and the one in flight (at cp=2 the one in use is its own)
        block = 2 * B * KV * (T // cp) * D * 4
        blocks = 1 + cp if how == "allgather" else min(cp, 3)
        assert got["stats"]["peak_kv_bytes"] == blocks * block, (got["stats"], blocks)
