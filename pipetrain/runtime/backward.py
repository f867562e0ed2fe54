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
  3. B asks the engine for the stage inputs' gradients and, in the same pass, for the
     gradient flowing into every boundary node (GradientEdge inputs: the engine records
     it when it reaches the node, which it runs anyway, being on the input path).
  4. W restarts autograd at the boundary nodes (GradientEdge roots fed the recorded
     gradients) and asks only for that group's parameters, so only the weight branches
     run. A group whose parameters can also be reached from a boundary through the
     input path (a weight reused up- and downstream inside one stage) would be counted
     twice that way; such a group is instead recomputed from the outputs (correct, and
     rare: GPT-2 and MLP stages never need it). A stage without a differentiable input
     (the first) has no input path: B does nothing and W is one full pass. A group bounded by
     a node computing input and weight gradients at once (a compiled graph's under trainer.compile,
     a selectively recomputed call's: a norm's scale inside) gets its gradients in B's pass, as
     re-running that node for W would compute (or recompute) it all again.

Steps 1-2 are Python graph walks. Every microbatch of a stage builds the same graph, so
their result (the *analysis*) is cached under the graph's structure: one breadth-first walk
numbers the nodes, and the key (node types, edges, which nodes are the parameters',
inputs' and outputs') finds an analysis made for an earlier microbatch, naming nodes by number.

Memory: B keeps the graph (retain_graph: W re-runs the boundary nodes) but, unless a
group is recomputed from them, not the outputs: what lies above the boundary nodes can go
when B returns. W's passes run disjoint sets of nodes (a node under the boundaries of two
groups off the input path would put its parameters in both, which merges them), so each
frees what it ran; the rest of the input path, which only B ran, goes with the last
reference to the graph. Unless a saved-tensor pack hook returned the very tensor it was
given (pipetrain's executor counts activation bytes that way): a node that saves its own
output (attention, layer norm, log-softmax) then holds that output, whose grad_fn is the
node, a cycle through C++ that Python's GC cannot see and that only running the node with
retain_graph=False breaks. The fused backward does that to every node; the nodes only B
ran never get it, so W breaks their cycles itself when it is done (`_untie`), or every
such graph would leak.

All engine passes call the engine directly (what torch.autograd.grad / backward do after
their Python argument checks, through `compat.run_backward`), as W makes one pass per parameter group.

`backward_full` (BW) is the ordinary fused backward.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from pipetrain.compat import is_view, run_backward, saved_tensor_data, saved_tensor_slots

_ANALYSIS_CACHE_SIZE = 64  # graph structures remembered (a few per stage: training, and any odd shapes)
_PLAIN = (torch.Tensor, torch.nn.Parameter, GradientEdge)
# nodes whose one backward gives input and weight gradients (trainer.compile; parallel/recompute.py)
_WHOLE = ("CompiledFunctionBackward", "_RecomputedBackward")


def _grad_node(t: torch.Tensor) -> Optional[Node]:
    """The autograd node producing t's gradient: grad_fn, or AccumulateGrad for a leaf."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad (created lazily)


def _run(roots: Sequence, seeds: Sequence[torch.Tensor], inputs: Sequence, *, keep: bool, accumulate: bool):
    """One autograd engine pass from `roots` (tensors or GradientEdges) fed `seeds`.

    accumulate=False returns the gradients of `inputs` (torch.autograd.grad, allow_unused);
    True adds them into the inputs' `.grad` (torch.autograd.backward(inputs=...)).
    """
    if all(type(x) in _PLAIN for x in (*roots, *inputs)):
        return run_backward(roots, seeds, inputs, keep=keep, accumulate=accumulate)
    # tensor subclasses: through the public API, which dispatches __torch_function__
    if accumulate:
        return torch.autograd.backward(list(roots), list(seeds), retain_graph=keep, inputs=list(inputs))
    return torch.autograd.grad(list(roots), list(inputs), list(seeds), retain_graph=keep, allow_unused=True)


@dataclass
class _GraphAnalysis:
    """A stage graph's analysis, naming nodes by their number in `_walk` order."""

    captures: list[tuple[int, int]]  # (node, input slot): the gradients B records
    # per group: its parameters (positions in `params`) and its W roots as
    # (node, input slot, k): the gradient is captures[k], or for k < 0 grad_outputs[-1 - k]
    groups: list[tuple[list[int], list[tuple[int, int, int]]]]
    recompute: list[int]  # parameters W recomputes from the outputs
    in_b: list[int]  # parameters B's pass computes (their boundary is a compiled graph's node)
    only_b: list[tuple[int, str]]  # (node, `_raw_saved_*` attribute) of input-path nodes W never runs


@dataclass
class WeightGradWork:
    """What B kept for W: per parameter group its W roots and their recorded gradients."""

    outputs: list[torch.Tensor]
    grad_outputs: list[Optional[torch.Tensor]]
    groups: list[tuple[list[torch.Tensor], list[GradientEdge], list[torch.Tensor]]] = field(default_factory=list)
    recompute: list[torch.Tensor] = field(default_factory=list)  # W: one pass from the outputs
    only_b: list[tuple[Node, str]] = field(default_factory=list)  # saved tensors `_untie` checks


_analyses: OrderedDict = OrderedDict()
_saved_attrs: dict[type, tuple[str, ...]] = {}


def _walk(out_nodes: Sequence[Node]) -> tuple[list[Node], dict[Node, int], list[tuple[tuple[int, int], ...]]]:
    """Every node reachable from the outputs, numbered breadth-first, and each node's edges as
    (child's number, the child's input slot they feed); (-1, 0) for an edge to nothing."""
    index: dict[Node, int] = {}
    order: list[Node] = []
    for n in out_nodes:
        if n not in index:
            index[n] = len(order)
            order.append(n)
    edges: list[tuple[tuple[int, int], ...]] = []
    for node in order:  # `order` grows while we iterate: a breadth-first walk
        es = []
        for child, slot in node.next_functions:
            if child is None:
                es.append((-1, 0))
                continue
            j = index.get(child)
            if j is None:
                j = index[child] = len(order)
                order.append(child)
            es.append((j, slot))
        edges.append(tuple(es))
    return order, index, edges


def _analysis_for(outputs: list[torch.Tensor], diff_inputs: list[torch.Tensor],
              params: list[torch.Tensor]) -> tuple[list[Node], _GraphAnalysis]:
    """This graph's nodes by number, and its analysis (cached under the graph's structure)."""
    out_nodes = [_grad_node(o) for o in outputs]
    order, index, edges = _walk([n for n in out_nodes if n is not None])
    by_id = {id(p): k for k, p in enumerate(params)}
    accs = [-1] * len(params)  # parameter -> its AccumulateGrad's number (-1: not in the graph)
    for i, node in enumerate(order):
        if not edges[i] and type(node).__name__ == "AccumulateGrad":
            k = by_id.get(id(node.variable))
            if k is not None:
                accs[k] = i
    ins = tuple(index.get(_grad_node(x), -1) for x in diff_inputs)
    outs = tuple((-1, 0) if n is None else (index[n], o.output_nr if o.grad_fn is not None else 0)
                 for o, n in zip(outputs, out_nodes))
    key = (tuple(map(type, order)), tuple(edges), outs, ins, tuple(accs))
    analysis = _analyses.get(key)
    if analysis is None:
        whole = {i for i, n in enumerate(order) if type(n).__name__ in _WHOLE}
        analysis = _analyses[key] = _analyse(order, edges, outs, ins, accs, whole)
        if len(_analyses) > _ANALYSIS_CACHE_SIZE:
            _analyses.popitem(last=False)
    else:
        _analyses.move_to_end(key)
    return order, analysis


def _analyse(order: list[Node], edges: list[tuple[tuple[int, int], ...]], outs: tuple[tuple[int, int], ...],
             ins: tuple[int, ...], accs: list[int], whole: set[int]) -> _GraphAnalysis:
    """Steps 1-2 of the module docstring, on node numbers."""
    kids = [tuple(c for c, _ in es if c >= 0) for es in edges]
    parents: list[list[int]] = [[] for _ in order]
    fed: list[set[int]] = [set() for _ in order]  # per node, the input slots gradients flow into
    for i, es in enumerate(edges):
        for c, slot in es:
            if c >= 0:
                parents[c].append(i)
                fed[c].add(slot)
    for n, nr in outs:
        if n >= 0:
            fed[n].add(nr)

    def closure_up(starts: Sequence[int], stop: set[int]) -> tuple[set[int], set[int]]:
        """Nodes reachable upward from `starts`, and the nodes of `stop` met (not crossed)."""
        visited, met = set(starts), set()
        queue = deque(starts)
        while queue:
            for p in parents[queue.popleft()]:
                if p in visited:
                    continue
                if p in stop:
                    met.add(p)
                    continue
                visited.add(p)
                queue.append(p)
        return visited, met

    out_nodes = {n for n, _ in outs if n >= 0}
    input_path, _ = closure_up([i for i in ins if i >= 0], set())
    # Output nodes off the input path also bound the weight branches (their grads are given).
    stop = input_path | out_nodes
    groups: dict[int, tuple[list[int], list[int]]] = {}  # id (creation order) -> (parameters, boundary nodes)
    group_of: dict[int, int] = {}  # boundary node -> group id
    made = 0
    for pos, acc in enumerate(accs):
        if acc < 0 or (not parents[acc] and acc not in out_nodes):
            continue  # parameter unused by this stage's outputs: no gradient
        met = {acc} if acc in stop else closure_up([acc], stop)[1]
        hit = sorted({group_of[b] for b in met if b in group_of})
        if hit:  # merge every group sharing one of these boundary nodes
            g = groups[hit[0]]
            for other in hit[1:]:
                params, boundary = groups.pop(other)
                g[0].extend(params)
                g[1].extend(b for b in boundary if b not in g[1])
            g[0].append(pos)
            g[1].extend(b for b in sorted(met) if b not in g[1])
            gid = hit[0]
        else:
            gid, made = made, made + 1
            g = groups[gid] = ([pos], sorted(met))
        for b in g[1]:
            group_of[b] = gid
    captures: list[tuple[int, int]] = []
    found_groups: list[tuple[list[int], list[tuple[int, int, int]]]] = []
    recompute: list[int] = []
    in_b: list[int] = []
    for gid in sorted(groups):
        params, boundary = groups[gid]
        if any(b in whole and b in input_path for b in boundary):
            in_b.extend(params)
            continue
        if _reaches_through_input_path(params, boundary, kids, parents, input_path, accs):
            recompute.extend(params)
            continue
        roots = []
        for b in boundary:
            if b in input_path:  # B records what flows into each of its fed input slots
                for slot in sorted(fed[b]):
                    roots.append((b, slot, len(captures)))
                    captures.append((b, slot))
            else:  # an output node B never runs: its gradients are the given grad_outputs
                roots.extend((b, nr, -1 - k) for k, (n, nr) in enumerate(outs) if n == b)
        found_groups.append((sorted(params), roots))
    bounds = {b for _, roots in found_groups for b, _, _ in roots}
    only_b = [(i, a) for i in sorted(input_path - bounds) for a in _saved_attributes(order[i])]
    return _GraphAnalysis(captures, found_groups, sorted(recompute), sorted(in_b), only_b)


def _reaches_through_input_path(params: list[int], boundary: list[int], kids: list[tuple[int, ...]],
                                parents: list[list[int]], input_path: set[int], accs: list[int]) -> bool:
    """True if a group parameter is reachable from a boundary node via another input-path node."""
    toward = {accs[p] for p in params}  # nodes with a path down to a group parameter
    queue = deque(toward)
    while queue:
        for p in parents[queue.popleft()]:
            if p not in toward:
                toward.add(p)
                queue.append(p)
    for b in boundary:
        queue = deque(c for c in kids[b] if c in toward)
        seen = set(queue)
        while queue:
            node = queue.popleft()
            if node in input_path:
                return True
            for c in kids[node]:
                if c in toward and c not in seen:
                    seen.add(c)
                    queue.append(c)
    return False


def _saved_attributes(node: Node) -> tuple[str, ...]:
    kind = type(node)
    names = _saved_attrs.get(kind)
    if names is None:
        names = _saved_attrs[kind] = saved_tensor_slots(node)
    return names


def _untie(saved: Sequence[tuple[Node, str]]) -> None:
    """Break node -> saved output -> node cycles left by an identity pack hook (module docstring).

    Only for nodes no pass runs again: what such a hook packed is the op's output itself,
    whose grad_fn is the node; detaching it in place drops that reference, so the graph is
    freed when its last owner lets go. Without such a hook the saved tensor has no grad_fn.
    """
    for node, attr in saved:
        try:
            packed = saved_tensor_data(node, attr)
        except Exception:  # freed (a pass from the outputs ran it), or not a saved tensor: nothing tied
            continue
        for t in packed:
            if isinstance(t, torch.Tensor) and t.grad_fn is node and not is_view(t):
                t.detach_()


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
    work = WeightGradWork(outputs, grad_outputs)
    if not diff_inputs:  # first stage: nothing flows back; W does the whole backward
        work.recompute = params
        return [None] * len(inputs), work
    order, analysis = _analysis_for(outputs, diff_inputs, params)
    edges = [GradientEdge(order[n], slot) for n, slot in analysis.captures]
    in_b = [params[k] for k in analysis.in_b]
    grads = _run(outputs, grad_outputs, diff_inputs + edges + in_b, keep=True, accumulate=False)
    captured = grads[len(diff_inputs): len(diff_inputs) + len(edges)]
    _accumulate(in_b, grads[len(diff_inputs) + len(edges):])
    for pos, roots in analysis.groups:
        group_roots, seeds = [], []
        for n, slot, k in roots:
            grad = captured[k] if k >= 0 else grad_outputs[-1 - k]
            if grad is not None:
                group_roots.append(GradientEdge(order[n], slot))
                seeds.append(grad)
        if group_roots:  # else no gradient reached the group: its parameters get none
            work.groups.append(([params[k] for k in pos], group_roots, seeds))
    work.recompute = [params[k] for k in analysis.recompute]
    work.only_b = [(order[n], attr) for n, attr in analysis.only_b]
    if not work.recompute:  # W starts at the boundaries: let the graph above them go now
        work.outputs, work.grad_outputs = [], []
    it = iter(grads[: len(diff_inputs)])
    return [next(it) if i.requires_grad else None for i in inputs], work


def backward_weight(work: WeightGradWork) -> None:
    """W: weight gradients from what B recorded, accumulated into `.grad`; frees the graph.

    One pass per group from its boundary nodes, each freeing what it ran. Parameters
    recomputed from the outputs (all of them on a first stage) take one pass last, which
    may run through the groups' boundary nodes: then the groups' passes keep the graph.
    """
    keep = bool(work.recompute) and bool(work.groups)
    for params, roots, seeds in work.groups:
        _run(roots, seeds, params, keep=keep, accumulate=True)
    if work.recompute:
        _run(work.outputs, work.grad_outputs, work.recompute, keep=False, accumulate=True)
    _untie(work.only_b)
    work.outputs.clear()
    work.grad_outputs.clear()
    work.groups.clear()
    work.recompute.clear()
    work.only_b.clear()


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                # Usually a fresh tensor, kept as is; but a sum's backward hands back the gradient
                # broadcast (stride 0), which later add_()s cannot write into: own memory then.
                p.grad = g if g.is_contiguous() else g.contiguous()
            else:
                p.grad.add_(g)


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
    if all(i.is_leaf and i.grad is None for i in diff_inputs):
        # The engine accumulates every gradient itself (the weights' into .grad, as
        # loss.backward() does; the inputs', fresh leaves, into theirs, taken back below): no
        # second pass adding returned gradients into .grad (1.5% of a GPT stage's step, py-spy).
        _run(outputs, grad_outputs, diff_inputs + params, keep=False, accumulate=True)
        taken = []
        for i in diff_inputs:
            taken.append(i.grad)
            i.grad = None
        input_grads = iter(taken)
    else:
        grads = torch.autograd.grad(list(outputs), diff_inputs + params, grad_outputs, allow_unused=True)
        _accumulate(params, grads[len(diff_inputs):])
        input_grads = iter(grads[: len(diff_inputs)])
    return [next(input_grads) if i.requires_grad else None for i in inputs]
