"""Selective activation recompute (trainer.recompute=selective): the calls a layer declares for each
of trainer.recompute_modules (parallel/layer_spec.py RecomputePlanned) run without keeping what they
would save; B runs them again to get their gradients.

Each call becomes one autograd node (`_Recomputed`) that saves only its tensor inputs (through the
saved-tensor hooks, so the executor's activation count sees them) and, in its backward, runs the call
again under grad with the forward's autocast state and differentiates it, for its inputs and for the
weights inside it (a norm's scale), which are the node's inputs too. The node lies on the input path
and computes its weights' gradients with its input's, so the split backward computes them in B, as
for a compiled graph's node (runtime/backward.py): W re-runs nothing of it.
Megatron's --recompute-modules keep the same cut (core attention, the MLP's
activation, the norms, MoE's activation, MLA's up-projections); torchtitan's per-op selective
recompute keeps matmul outputs and recomputes the rest alike. Under trainer.compile the wrapped call
runs eager (torch.compiler.disable): its backward calls autograd, which a compiled graph cannot hold.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Collection, Sequence

import torch
from torch import nn

from pipetrain.parallel.layer_spec import RecomputePlanned


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], n: int, *tensors: torch.Tensor) -> Any:
        """`tensors`: the call's n tensor inputs, then the weights it uses (inputs of this node, not saved)."""
        ctx.run, ctx.weights = run, tensors[n:]
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
        ctx.save_for_backward(*tensors[:n])
        with torch.no_grad():
            return run(*tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), _autocast(ctx.autocast):
            out = ctx.run(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        wrt = [t for t in (*inputs, *ctx.weights) if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs and wrt else [None] * len(wrt))
        return (None, None, *(next(got) if t.requires_grad else None for t in (*inputs, *ctx.weights)))


class _autocast:
    """The forward's autocast state per device type, again in the recompute."""

    def __init__(self, states: list[tuple[str, bool, torch.dtype]]) -> None:
        self.managers = [torch.autocast(d, dtype=dtype, enabled=on) for d, on, dtype in states
                         if on or torch.is_autocast_enabled(d)]

    def __enter__(self) -> None:
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self.managers):
            m.__exit__(*exc)


def recomputed(method: Callable[..., Any], *, weights: Sequence[str], compiled: bool) -> Callable[..., Any]:
    """A module's `method` (its class's function) whose tensor arguments alone are kept; other arguments
    (documents, None) ride along. `weights`: the paths under the module ("" itself) of the sub-modules whose
    weights the call uses (read at each call: FSDP2 swaps them after this step). Bound to the module
    (types.MethodType), a deep copy binds to the copy."""
    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return method(module, *args, **kwargs)
        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def again(*tensors: torch.Tensor) -> Any:
            full = list(args)
            for i, t in zip(where, tensors):
                full[i] = t
            return method(module, *full, **kwargs)
        used = [p for w in weights for p in module.get_submodule(w).parameters()]
        return _Recomputed.apply(again, len(where), *(args[i] for i in where), *used)
    return torch.compiler.disable(run) if compiled else run


def recompute_modules(layer: nn.Module, modules: Collection[str], *, compiled: bool) -> list[str]:
    """Wraps the layer's declared calls of `modules` in place; returns the module names it had (a layer
    without a declared module skips it)."""
    if not isinstance(layer, RecomputePlanned):
        return []
    plan = layer.recompute_plan()
    found = [m for m in modules if plan.get(m)]
    for name in found:
        for path, method, *weights in plan[name]:
            owner = layer.get_submodule(path) if path else layer
            run = recomputed(getattr(type(owner), method), weights=("",) if method == "forward" else weights,
                             compiled=compiled)
            setattr(owner, method, types.MethodType(run, owner))  # a forward uses its module's weights
    return found
