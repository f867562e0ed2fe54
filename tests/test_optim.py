"""Global grad norm and clipping (train/optim.py) against a plain per-parameter reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipetrain.train.optim import clip_grads, global_grad_norm

pytestmark = pytest.mark.pure
CPU = torch.device("cpu")


def params(*grads):
    out = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(3))
        p.grad = None if g is None else g.clone()
        out.append(p)
    return out


def reference(ps):
    """The loop the foreach version replaces: squares summed in fp64."""
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ps if p.grad is not None))


def test_norm_matches_the_plain_reference_over_mixed_shapes_and_missing_grads():
    torch.manual_seed(0)
    ps = params(torch.randn(4, 5), None, torch.randn(7), torch.randn(2, 3, 2) * 1e3, torch.randn(1))
    assert global_grad_norm(ps, device=CPU) == pytest.approx(reference(ps), rel=1e-6)


def test_norm_of_nothing_is_zero():
    assert global_grad_norm([], device=CPU) == 0.0
    assert global_grad_norm(params(None, None), device=CPU) == 0.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_grads_give_a_non_finite_norm_and_clipping_leaves_them(bad):
    ps = params(torch.ones(3), torch.tensor([1.0, bad]))
    norm = global_grad_norm(ps, device=CPU)
    assert not math.isfinite(norm) and math.isnan(norm) == math.isnan(reference(ps))
    before = [p.grad.clone() for p in ps]
    clip_grads(ps, norm, max_norm=1.0)
    for p, g in zip(ps, before):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())


def test_clipping_scales_every_grad_to_max_norm_and_leaves_small_ones():
    torch.manual_seed(1)
    ps = params(torch.randn(10) * 5, None, torch.randn(3, 3) * 5)
    norm = global_grad_norm(ps, device=CPU)
    expected = [p.grad * (1.0 / (norm + 1e-6)) if p.grad is not None else None for p in ps]
    clip_grads(ps, norm, max_norm=1.0)
    assert global_grad_norm(ps, device=CPU) == pytest.approx(1.0, rel=1e-5)
    for p, e in zip(ps, expected):
        assert (p.grad is None and e is None) or torch.allclose(p.grad, e)
    small = [p.grad.clone() for p in ps if p.grad is not None]
    clip_grads(ps, 1.0, max_norm=2.0)  # under max_norm: untouched
    clip_grads(ps, 5.0, max_norm=0.0)  # clipping off
    assert all(torch.equal(a, p.grad) for a, p in zip(small, [p for p in ps if p.grad is not None]))


def test_the_cosine_ends_at_decay_steps_then_stays_at_min_lr():
    from pipetrain.config.train import OptimConfig
    from pipetrain.train.optim import lr_at

    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2)
    assert lr_at(1, cfg, 10) == pytest.approx(1.0)  # end of the warm-up
    assert lr_at(6, cfg, 10) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(10, cfg, 10) == lr_at(50, cfg, 10) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="optim.decay_steps must be >= 1"):
        OptimConfig(decay_steps=0)


def _adamw_run(make):
    """Five steps of an AdamW from `make` on two groups (decay, no decay), with a zero_grad between and a
    state_dict round trip in the middle: the parameters and the state after them."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    opt = make([{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}])
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(len(calls)))
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        (ps[0].sum() * (i + 1) + ps[1].pow(2).sum()).backward()
        opt.step()
        if i == 2:
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in ps], opt.state_dict(), calls


def test_adamw_without_dynamo_is_torchs_adamw():
    """compat.AdamW runs torch's own bodies: the same parameters and state, bit for bit, and torch's step
    hooks, whether or not torch._dynamo is imported (this process may have it: then torch's wrappers run)."""
    from pipetrain.compat import AdamW

    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours, ref = _adamw_run(lambda g: AdamW(g, **kw)), _adamw_run(lambda g: torch.optim.AdamW(g, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ref[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ours[1]["state"].values(), ref[1]["state"].values())
               for k in a)
    assert ours[1]["param_groups"] == ref[1]["param_groups"] and ours[2] == ref[2] == [0, 1, 2, 3, 4]


def test_the_trainers_optimizer_imports_no_dynamo():
    """Building and stepping the trainer's optimizer imports no torch._dynamo (~1.4 s of CPU in every rank;
    the fork server preloads it only for trainer.compile: launch/forkserver.py preload)."""
    import subprocess
    import sys

    code = """
import sys, torch
from pipetrain.config.train import OptimConfig
from pipetrain.train.optim import make_optimizer
p = torch.nn.Parameter(torch.randn(3, 3))
opt = make_optimizer([p], OptimConfig(lr=1e-3), device=torch.device("cpu"))
p.sum().backward(); opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
