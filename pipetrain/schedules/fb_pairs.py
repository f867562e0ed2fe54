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
start, in flight beside any other (gloo's worker threads, the network). The simulator's F&B model
(schedules/simulate.py StageCosts.layers) is this chain.
"""

from __future__ import annotations

from typing import Mapping, Sequence

MOE_NODES = ("attn", "dispatch", "experts", "combine", "post")
COMM_NODES = frozenset({"dispatch", "combine"})
PAIR_ORDER: tuple[tuple[str, str], ...] = (
    ("B", "post"), ("B", "combine"), ("F", "attn"), ("F", "dispatch"), ("B", "experts"),
    ("B", "dispatch"), ("F", "experts"), ("F", "combine"), ("B", "attn"), ("F", "post"))


def chain_ms(f: Mapping[str, float], b: Mapping[str, float], order: Sequence[tuple[str, str]] = PAIR_ORDER) -> float:
    """An MoE layer pair run in `order`, ms: `f` / `b` the forward's / backward's node times by name
    (an all-to-all's from its start to its arrival)."""
    t, arrives, ms = 0.0, {"F": 0.0, "B": 0.0}, {"F": f, "B": b}
    for side, name in order:
        if name in COMM_NODES:
            arrives[side] = t + ms[side][name]
        else:
            t = max(t, arrives[side]) + ms[side][name]
    return max(t, *arrives.values())
