"""Expert-parallel dispatch and combine (runtime/ep_comm.py) on real gloo ranks: the experts of
an MoE layer split over ep=2 and ep=4 ranks give every rank's tokens the outputs and the input and
weight gradients one process computes with all the experts, for uneven (and empty) splits."""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.models.moe import Experts, dispatch as sort_by_expert

pytestmark = pytest.mark.dist

E, H, I, T, K = 8, 16, 24, 12, 2


def experts(seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    ex = Experts(E, hidden=H, intermediate=I)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return ex


def tokens(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:, 0] = torch.where(ids[:, 0] == E - 1, 0, ids[:, 0])  # expert E-1 gets fewer; some ranks none
    return x, ids


def run_local(x, ids, ex):
    d = sort_by_expert(ids, None, E)
    y = ex(x[d.tokens], d.counts)  # (T K, H) expert-major
    return y, d


def ep_rank(rank: int, world: int, out) -> None:
    import torch.distributed as dist

    from pipetrain.runtime.ep_comm import EPGroup, combine, dispatch

    g = EPGroup(dist.group.WORLD, world, rank)
    whole = experts()
    local = Experts(E // world, hidden=H, intermediate=I)
    block = slice(rank * E // world, (rank + 1) * E // world)
    with torch.no_grad():
        for name, p in local.named_parameters():
            p.copy_(getattr(whole, name)[block])
    x, ids = tokens(rank)
    x.requires_grad_(True)
    d = sort_by_expert(ids, None, E)
    rows, counts, routed = dispatch(x[d.tokens], d.counts, g)
    y = combine(local(rows, counts), routed, g)
    w = torch.linspace(-1, 1, y.numel()).view_as(y)  # a loss that weighs every output element differently
    (y * w).sum().backward()
    torch.save({"y": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in local.named_parameters()},
                "block": (block.start, block.stop)}, out / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_ep_dispatch_combine_equals_all_experts_in_one_process(tmp_path, world):
    spawn(ep_rank, world, tmp_path)
    whole = experts()
    total = {n: torch.zeros_like(p) for n, p in whole.named_parameters()}
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        x, ids = tokens(rank)
        x.requires_grad_(True)
        ref = experts()
        y, d = run_local(x, ids, ref)
        w = torch.linspace(-1, 1, y.numel()).view_as(y)
        (y * w).sum().backward()
        torch.testing.assert_close(got["y"], y.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["dx"], x.grad, rtol=1e-6, atol=1e-6)
        for n, p in ref.named_parameters():
            total[n] += p.grad
    for rank in range(world):  # an expert's gradient sums every rank's tokens, on the rank holding it
        got = torch.load(tmp_path / f"rank{rank}.pt")
        start, stop = got["block"]
        for n, grad in got["grads"].items():
            torch.testing.assert_close(grad, total[n][start:stop], rtol=1e-5, atol=1e-6)
