"""Expert-parallel dispatch and combine (runtime/ep_comm.py) on real gloo ranks, as an MoE layer runs
them (models/moe.py MoE.phases under whole-stage execution): the experts of an MoE layer split over
ep=2 and ep=4 ranks give every rank's tokens the outputs, input gradients and router and shared-expert
gradients one process computes with all the experts, and the experts the sum of every rank's tokens'
gradients, for uneven (and empty) splits: the last expert is never chosen."""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.config.moe import MoEConfig
from pipetrain.models.moe import MoE

pytestmark = pytest.mark.dist

E, H, I, T, K = 8, 16, 24, 12, 2


def moe(seed: int = 0) -> MoE:
    layer = MoE(MoEConfig(num_experts=E, top_k=K, balance="aux_loss", aux_loss_coef=0.1, num_shared_experts=1),
                hidden=H, intermediate=I)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.2, generator=g)
        layer.router.expert_bias[E - 1] = -10.0  # scores are in [0, 1]: expert E-1 gets no token on any rank
    return layer


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(100 + rank))  # (B, T, H)


def forward_backward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The output (detached); x and the parameters hold the gradients of a loss that weighs every
    output element differently, plus the balance loss."""
    res = layer(x)
    w = torch.linspace(-1, 1, res.out.numel()).view_as(res.out)
    ((res.out * w).sum() + res.aux_loss).backward()
    return res.out.detach()


def ep_rank(rank: int, world: int, out) -> None:
    import torch.distributed as dist

    from pipetrain.parallel.ep import shard_experts
    from pipetrain.runtime.ep_comm import EPGroup

    layer = moe()
    shard_experts(layer.experts, EPGroup(dist.group.WORLD, world, rank))
    x = tokens(rank).requires_grad_(True)
    y = forward_backward(layer, x)
    torch.save({"y": y, "dx": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}},
               out / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_ep_dispatch_combine_equals_all_experts_in_one_process(tmp_path, world):
    spawn(ep_rank, world, tmp_path)
    total = {n: torch.zeros_like(p) for n, p in moe().experts.named_parameters()}
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        ref = moe()
        x = tokens(rank).requires_grad_(True)
        torch.testing.assert_close(got["y"], forward_backward(ref, x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["dx"], x.grad, rtol=1e-6, atol=1e-6)
        for n, p in ref.named_parameters():
            if n.startswith("experts."):
                total[n.removeprefix("experts.")] += p.grad
            elif p.requires_grad:  # the router and the shared experts: this rank's tokens alone
                torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert all(float(g[E - 1].abs().max()) == 0.0 for g in total.values()), "expert E-1 got no token"
    for rank in range(world):  # an expert's gradient sums every rank's tokens, on the rank holding it
        got = torch.load(tmp_path / f"rank{rank}.pt")
        block = slice(rank * E // world, (rank + 1) * E // world)
        for n, grad in total.items():
            torch.testing.assert_close(got["grads"][f"experts.{n}"], grad[block], rtol=1e-5, atol=1e-6, msg=n)
