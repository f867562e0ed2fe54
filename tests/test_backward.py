"""Split backward (B then W) gives exactly the gradients of the fused backward, on real graphs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.runtime.backward import backward_full, backward_input, backward_weight

pytestmark = pytest.mark.pure


class Block(nn.Module):
    """A GPT-2-style block: the qkv split is a multi-output autograd node on the input path."""

    def __init__(self, C: int, H: int):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(C), nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.ln2, self.fc, self.fc2, self.H = nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.Linear(4 * C, C), H

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TiedInside(nn.Module):
    """One weight used up- and downstream inside a stage (the double-count hazard)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(torch.tanh(self.b(F.linear(x, self.a.weight))), self.a.weight)


class LossHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return F.cross_entropy(self.lin(x), torch.tensor([0, 1, 2, 0]))


def grads_both_ways(model, x, grad_out):
    params = list(model.parameters())

    def fresh():
        for p in params:
            p.grad = None
        return x.detach().requires_grad_(x.is_floating_point())

    xin = fresh()
    ref_in = backward_full([model(xin)], [grad_out], [xin], params)
    ref = [None if p.grad is None else p.grad.clone() for p in params]
    xin = fresh()
    got_in, work = backward_input([model(xin)], [grad_out], [xin], params)
    assert all(p.grad is None for p in params), "B must not touch weight grads"
    backward_weight(work)
    return ref_in, ref, got_in, [p.grad for p in params]


@pytest.mark.parametrize(
    "make, x, grad_out",
    [
        (lambda: nn.Sequential(Block(32, 4), Block(32, 4)), torch.randn(2, 8, 32), torch.randn(2, 8, 32)),
        (TiedInside, torch.randn(4, 8), torch.randn(4, 8)),
        (LossHead, torch.randn(4, 8), None),
        (lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)), torch.randint(0, 10, (4, 5)),
         torch.randn(4, 5, 8)),
        (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6)), torch.randn(5, 6), torch.randn(5, 6)),
    ],
    ids=["gpt-blocks", "weight-reused-inside", "loss-head", "first-stage-embedding", "mlp"],
)
def test_split_equals_fused(make, x, grad_out):
    torch.manual_seed(0)
    model = make()
    ref_in, ref, got_in, got = grads_both_ways(model, x, grad_out)
    for a, b in zip(ref, got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    if ref_in[0] is None:
        assert got_in[0] is None
    else:
        torch.testing.assert_close(got_in[0], ref_in[0], atol=1e-6, rtol=1e-5)


def test_weight_grads_accumulate_over_microbatches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    xs, gs = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    works = []
    for x, g in zip(xs, gs):  # three B's first, W's later (as ZB-H1 defers them)
        xin = x.clone().requires_grad_()
        works.append(backward_input([model(xin)], [g], [xin], list(model.parameters()))[1])
    for w in works:
        backward_weight(w)
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for x, g in zip(xs, gs):
        model(x).backward(g)
    for a, b in zip(split, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


def test_full_backward_accumulates_into_a_broadcast_gradient():
    # w.sum()'s backward is the gradient expanded (stride 0): .grad must get its own memory
    w = nn.Parameter(torch.zeros(5))
    for _ in range(3):
        x = torch.ones(2, 3, requires_grad=True)
        y = x * (1 + w.sum())
        backward_full([y], [torch.ones_like(y)], [x], [w])
    torch.testing.assert_close(w.grad, torch.full((5,), 18.0))
