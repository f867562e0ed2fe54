"""Split backward without recomputation: B (input grad) now, W (weight grads) later.

Zero-bubble schedules (Qi et al. 2024) and DualPipe run the backward of a stage in
two parts. `backward_input` computes only d(loss)/d(stage input) and keeps what the
weight gradients need; `backward_weight` later computes the weight gradients from
that, without re-running the input-gradient chain. It works on any autograd graph,
not only hand-written layers:

  1. From the stage outputs, walk the autograd graph. The *input path* is every node
     from which a stage input's gradient node can be reached.
  2. For each parameter, walk up from its AccumulateGrad node until the first nodes on
     the input path: its *boundary* nodes. Parameters are grouped by shared boundary
     nodes (a weight used twice joins the groups of both uses).
  3. During B, a pre-hook on every boundary node records the gradient flowing into it
     (the node runs anyway, since it is on the input path).
  4. W restarts autograd at the boundary nodes (GradientEdge roots fed the recorded
     gradients) and asks only for that group's parameters, so only the weight branches
     run. A group whose parameters can also be reached from a boundary through the
     input path (a weight reused up- and downstream inside one stage) would be counted
     twice that way; such a group is instead recomputed from the outputs (correct, and
     rare: GPT-2 and MLP stages never need it).

`backward_full` (BW) is the ordinary fused backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _grad_node(t: torch.Tensor) -> Optional[Node]:
    """The autograd node producing t's gradient: grad_fn, or AccumulateGrad for a leaf."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad (created lazily)


def _reverse_edges(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """child -> parents over the graph reachable from `roots` (parents compute grads first)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _closure_up(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set, set]:
    """Nodes reachable upward from `starts`; returns (visited, nodes of `stop` met, not crossed)."""
    visited, met = set(), set()
    queue = deque(n for n in starts if n is not None)
    visited.update(queue)
    while queue:
        node = queue.popleft()
        for p in parents.get(node, ()):
            if p in visited:
                continue
            if p in stop:
                met.add(p)
                continue
            visited.add(p)
            queue.append(p)
    return visited, met


@dataclass
class _Group:
    params: list[torch.Tensor]
    boundary: list[Node]
    recompute: bool = False
    grads: dict = field(default_factory=dict)  # boundary node -> tuple of recorded grads


@dataclass
class WeightGradWork:
    """What B kept for W: the parameter groups, their recorded gradients, and the graph."""

    outputs: list[torch.Tensor]
    grad_outputs: list[Optional[torch.Tensor]]
    groups: list[_Group]


def _param_groups(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[list[_Group], set[Node]]:
    out_nodes = [n for n in (_grad_node(o) for o in outputs) if n is not None]
    parents = _reverse_edges(out_nodes)
    in_nodes = [n for n in (_grad_node(i) for i in inputs) if n is not None]
    input_path, _ = _closure_up(in_nodes, parents, stop=set())
    # Output nodes off the input path also bound the weight branches (their grads are known).
    stop = input_path | set(out_nodes)
    groups: list[_Group] = []
    by_boundary: dict[Node, _Group] = {}
    for p in params:
        acc = _grad_node(p)
        if acc not in parents and acc not in out_nodes:
            continue  # parameter unused by this stage's outputs: no gradient
        _, met = _closure_up([acc], parents, stop)
        if acc in stop:
            met = {acc}
        hit = [by_boundary[n] for n in met if n in by_boundary]
        if hit:  # merge every group sharing one of these boundary nodes
            g = hit[0]
            for other in hit[1:]:
                if other is not g and other in groups:
                    g.params += other.params
                    g.boundary += [n for n in other.boundary if n not in g.boundary]
                    groups.remove(other)
            g.params.append(p)
            g.boundary += [n for n in met if n not in g.boundary]
        else:
            g = _Group([p], list(met))
            groups.append(g)
        for n in g.boundary:
            by_boundary[n] = g
    for g in groups:
        g.recompute = _reaches_through_input_path(g, parents, input_path)
    return groups, input_path


def _reaches_through_input_path(g: _Group, parents: dict[Node, list[Node]], input_path: set[Node]) -> bool:
    """True if a group parameter is reachable from a boundary node via another input-path node."""
    accs = [_grad_node(p) for p in g.params]
    toward, _ = _closure_up(accs, parents, stop=set())  # nodes with a path down to a group param
    for b in g.boundary:
        queue = deque(c for c, _ in b.next_functions if c is not None and c in toward)
        seen = set(queue)
        while queue:
            node = queue.popleft()
            if node in input_path:
                return True
            for c, _ in node.next_functions:
                if c is not None and c in toward and c not in seen:
                    seen.add(c)
                    queue.append(c)
    return False


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[Optional[torch.Tensor]], WeightGradWork]:
    """B: gradients w.r.t. `inputs` only; returns them and the work W needs later."""
    outputs = list(outputs)
    # A scalar loss gets its implicit seed of 1 made explicit: W may restart from the loss node.
    grad_outputs = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    params = [p for p in params if p.requires_grad]
    diff_inputs = [i for i in inputs if i.requires_grad]
    groups, input_path = _param_groups(outputs, diff_inputs, params)
    work = WeightGradWork(outputs, grad_outputs, groups)
    if not diff_inputs:  # first stage: nothing flows back; W does the whole backward
        for g in groups:
            g.recompute = True
        return [None] * len(inputs), work
    # Grads of output nodes that B never runs (off the input path) are the given grad_outputs.
    seeded: dict[Node, list[Optional[torch.Tensor]]] = {}
    for o, grad in zip(outputs, grad_outputs):
        node = _grad_node(o)
        slots = seeded.setdefault(node, [])
        nr = o.output_nr if o.grad_fn is not None else 0
        slots.extend([None] * (nr + 1 - len(slots)))
        slots[nr] = grad
    handles = []
    for g in groups:
        for node in g.boundary:
            if node not in input_path:
                g.grads[node] = tuple(seeded.get(node, ()))
                continue

            def record(grads, g=g, node=node):
                g.grads[node] = tuple(x.detach() if x is not None else None for x in grads)

            handles.append(node.register_prehook(record))
    try:
        grads = torch.autograd.grad(outputs, diff_inputs, grad_outputs, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    it = iter(grads)
    return [next(it) if i.requires_grad else None for i in inputs], work


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g  # autograd.grad returns a fresh tensor: no copy needed
            else:
                p.grad.add_(g)


def backward_weight(work: WeightGradWork) -> None:
    """W: weight gradients from what B recorded, accumulated into `.grad`; frees the graph."""
    # Groups without recorded boundaries (the first stage, or a weight reused inside the
    # stage) take one fused pass from the outputs, so the graph is walked once, not per group.
    redo = [p for g in work.groups if g.recompute for p in g.params]
    if redo:
        grads = torch.autograd.grad(work.outputs, redo, work.grad_outputs, retain_graph=True, allow_unused=True)
        _accumulate(redo, grads)
    for g in work.groups:
        if g.recompute:
            continue
        roots, seeds = [], []
        for node in g.boundary:
            for i, grad in enumerate(g.grads.get(node, ())):
                if grad is not None:
                    roots.append(GradientEdge(node, i))
                    seeds.append(grad)
        if roots:
            grads = torch.autograd.grad(roots, g.params, seeds, retain_graph=True, allow_unused=True)
            _accumulate(g.params, grads)
    work.outputs.clear()
    work.grad_outputs.clear()
    work.groups.clear()


def backward_full(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> list[Optional[torch.Tensor]]:
    """BW: input and weight gradients in one autograd pass; weight grads accumulate into `.grad`."""
    params = [p for p in params if p.requires_grad]
    diff_inputs = [i for i in inputs if i.requires_grad]
    grad_outputs = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    grads = torch.autograd.grad(list(outputs), diff_inputs + params, grad_outputs, allow_unused=True)
    _accumulate(params, grads[len(diff_inputs):])
    it = iter(grads[: len(diff_inputs)])
    return [next(it) if i.requires_grad else None for i in inputs]
