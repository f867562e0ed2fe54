"""How one F&B pair of MoE layers runs node by node: the order and what it costs (pure: no torch).

An MoE block under expert parallel is five nodes (models/moe_nodes.py): attn (attention, routing,
counts exchange), dispatch (all-to-all), experts, combine (all-to-all), post. A forward runs them in
that order, a backward in reverse. In an F&B pair, forward layer i and backward layer j run in
`PAIR_ORDER` (runtime/overlap.py follows it; `↑` an all-to-all started, waited by the next node of its
side that reads its result):

  B.post  B.combine↑  F.attn  F.dispatch↑  B.experts  B.dispatch↑  F.experts  F.combine↑  B.attn  F.post

Megatron's order (combined_1f1b: its moe_combine node split into post and combine), so every
all-to-all has a compute node of the other microbatch to hide behind: B.combine under F.attn,
F.dispatch under B.experts, B.dispatch under F.experts, F.combine under B.attn. (Issuing F.attn first
leaves B.combine nothing to hide behind: measured on real gloo, 0.42-0.57x of the serial exposed
all-to-all against 0.19-0.20x with this order, bench/moe_fb_overlap.py.)

`chain_ms` prices the pair as the executor runs it on one thread: a compute node starts when the
thread is free and its side's last all-to-all has arrived; an all-to-all takes its time from its
start, in flight beside any other (a latency: gloo's worker threads, the bench's emulated delay), or,
with `one_link`, queued behind the one before on a shared link (times that are bytes over
cluster.ep_bandwidth_gbs: then a pair costs at least the larger of its compute and its all-to-alls,
issue #29's first model, and more where a node waits on its own side). The simulator's F&B model
(schedules/simulate.py StageCosts.layers) is this chain: per layer a `LayerNodes` (forward and backward
node times and W), and a pair of layers saves `pair_saving`, its serial time less `chain_ms`.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

# An MoE block's nodes (models/moe.py MoE.phases names its phases so, models/moe_nodes.py adds the
# block's attention and residual; runtime/overlap.py pairs them by these names): one constant each,
# so a renamed node cannot silently leave a pair serial.
ATTN, DISPATCH, EXPERTS, COMBINE, POST = "attn", "dispatch", "experts", "combine", "post"
MOE_NODES = (ATTN, DISPATCH, EXPERTS, COMBINE, POST)
COMM_NODES = frozenset({DISPATCH, COMBINE})
PAIR_ORDER: tuple[tuple[str, str], ...] = (
    ("B", POST), ("B", COMBINE), ("F", ATTN), ("F", DISPATCH), ("B", EXPERTS),
    ("B", DISPATCH), ("F", EXPERTS), ("F", COMBINE), ("B", ATTN), ("F", POST))


def chain_ms(f: Mapping[str, float], b: Mapping[str, float], order: Sequence[tuple[str, str]] = PAIR_ORDER, *,
             one_link: bool = False) -> float:
    """An MoE layer pair run in `order`, ms: `f` / `b` the forward's / backward's node times by name
    (an all-to-all's from its start to its arrival). `one_link`: the all-to-alls share one link, each
    starting when it is issued and the one before has arrived (times that are bytes over a bandwidth,
    cluster.ep_bandwidth_gbs); else each runs from its issue, beside any other (a latency, as measured)."""
    t, link, arrives, ms = 0.0, 0.0, {"F": 0.0, "B": 0.0}, {"F": f, "B": b}
    for side, name in order:
        if name in COMM_NODES:
            arrives[side] = (max(t, link) if one_link else t) + ms[side][name]
            link = arrives[side]
        else:
            t = max(t, arrives[side]) + ms[side][name]
    return max(t, *arrives.values())


class PassNodes(NamedTuple):
    """One pass (forward, or backward for the input gradients) of one layer, ms per node in MOE_NODES order
    (a backward runs them in reverse): a compute node's time, an all-to-all's from its start to its
    arrival. A layer without all-to-alls (dense, embedding, head, MoE without expert parallel) has
    dispatch = combine = 0."""

    attn: float = 0.0
    dispatch: float = 0.0
    experts: float = 0.0
    combine: float = 0.0
    post: float = 0.0

    @property
    def a2a(self) -> float:
        return self.dispatch + self.combine


class LayerNodes(NamedTuple):
    """One layer of one microbatch as the F&B overlap model sees it: its forward's and its backward's (B)
    node times, and w, its weight gradients' time (W)."""

    f: PassNodes
    b: PassNodes
    w: float = 0.0

    @classmethod
    def split(cls, *, f_ms: float, b_ms: float, w_ms: float, comm_f_ms: float, comm_b_ms: float,
              experts_share: float, post_share: float = 0.0) -> "LayerNodes":
        """A layer's nodes from its totals (partition/costs.py LayerCost): dispatch and combine each half of
        a pass's all-to-all time (they move the same rows, there and back), the rest of the pass compute
        split between experts (`experts_share` of it: the routed experts' share of the layer's FLOPs), post
        (`post_share`: the shared experts'; its gates and residual cost ~0) and attn (attention, norms,
        router: the rest)."""
        def one(total: float, comm: float) -> PassNodes:
            compute = total - comm
            experts, post = compute * experts_share, compute * post_share
            return PassNodes(compute - experts - post, comm / 2, experts, comm / 2, post)
        return cls(one(f_ms, comm_f_ms), one(b_ms, comm_b_ms), w_ms)

    def backward(self, with_w: bool) -> PassNodes:
        """The backward's nodes; `with_w` (a BW action) computes the weight gradients inside its compute
        nodes: w spread over attn, experts and post in proportion to their B time (all on experts where B
        has none), post taking the remainder so the three gain exactly w."""
        b = self.b
        if not with_w or not self.w:
            return b
        compute = b.attn + b.experts + b.post
        attn, experts = (self.w * b.attn / compute, self.w * b.experts / compute) if compute else (0.0, self.w)
        return b._replace(attn=b.attn + attn, experts=b.experts + experts, post=b.post + (self.w - attn - experts))


def pair_saving(fwd: LayerNodes, bwd: LayerNodes, *, with_w: bool, one_link: bool = False) -> float:
    """What forward layer `fwd` and backward layer `bwd` of an F&B pair save, ms, run in PAIR_ORDER instead
    of one after the other: their serial time less `chain_ms` (`one_link` as there). Only two layers that
    both have all-to-alls interleave (runtime/overlap.py fb_order); any other pair runs serially and saves
    nothing."""
    if not (fwd.f.a2a > 0 and bwd.b.a2a > 0):
        return 0.0
    b = bwd.backward(with_w)
    return sum(fwd.f) + sum(b) - chain_ms(fwd.f._asdict(), b._asdict(), one_link=one_link)
