"""bench/moe_fb_overlap.py's simulator check: measured per-layer compute and all-to-all times -> the
simulator's F&B overlap model (schedules/simulate.py StageCosts.layers) -> simulated F&B and step ms.

On the serial row (pipeline.fb_overlap=serial: every node run in order, every all-to-all waited by the
next node) each node is timed (`timed_nodes`), and the node log's spans give each all-to-all's time
from its start to its arrival; a node's compute is its time less the waits inside it. Per stage and
layer (forward order): (Fc, Fa, Bc, Ba, Wc), the median over microbatches; per stage the actions' F,
B, W and BW times as measured. The F&B pairs' backward here is BW, whose nodes also run the weight
gradients: Bc carries them and Wc is 0.

The simulator prices an MoE layer pair at max(Fc + Bc, Fa + Ba): the all-to-alls as one serial lane
beside the compute. The executor's order (runtime/overlap.py) is a chain: a compute node waits for its
own side's last all-to-all, two all-to-alls can be in flight at once, and the one whose output the
next node needs at once stays exposed. `ChainCosts` prices the pair as that chain (`chain_ms`), from
the measured per-node times; both are reported against the measured overlap.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from pipetrain.schedules.ir import Action, Op, Overlap
from pipetrain.schedules.simulate import StageCosts, simulate

_MOE_F = ("attn", "dispatch", "experts", "combine", "post")


class NodeTimes(list):
    """Per node run: (side F|B, layer key, node name, start, end), perf_counter seconds; `calls` marks
    where each run (one microbatch's forward or backward of one stage) began."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def clear(self) -> None:
        super().clear()
        self.calls.clear()


def timed_nodes(nodes: Any) -> NodeTimes:
    """Time every node the NodeExecution runs serially (its `run`; the serial F&B pair calls it too)."""
    times = NodeTimes()

    def run(steps: list) -> None:
        times.calls.append(len(times))
        for layer in steps:
            names = tuple(n.name for n, _ in layer)
            side = "B" if names == _MOE_F[::-1] else "F"  # single-node layers: no all-to-all, side unused
            for node, step in layer:
                t0 = time.perf_counter()
                step()
                times.append((side, node.layer, node.name, t0, time.perf_counter()))

    nodes.run = run  # the instance's, before the class's staticmethod
    return times


def stage_costs(timings: list, log: Any, times: NodeTimes, plans: dict, steps: list) -> dict[str, Any]:
    """One serial step's costs per local stage: {stage: {f, b, w, bw, layers}} (ms; medians over microbatches)."""
    waits = [(w, done) for _, _, w, done in log.spans]
    # (side, layer, node name or "") -> ms per run (one microbatch); "" sums the layer's nodes
    per: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    bounds = times.calls + [len(times)]
    for a, b in zip(bounds, bounds[1:]):
        run: dict[tuple[str, str, str], float] = defaultdict(float)
        for side, layer, name, t0, t1 in times[a:b]:
            blocked = sum(max(0.0, min(t1, done) - max(t0, w)) for w, done in waits)
            run[(side, layer, name)] += 1e3 * (t1 - t0 - blocked)
            run[(side, layer, "")] += 1e3 * (t1 - t0 - blocked)
        for key, ms in run.items():
            per[key].append(ms)
    a2a: dict[tuple[str, str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (side, _, mb, layer, name), (_, began, _, done) in zip(log.started, log.spans):
        a2a[(side, layer, name)][mb] += 1e3 * (done - began)
        a2a[(side, layer, "")][mb] += 1e3 * (done - began)
    acts: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for t in timings:
        step = steps[t.index]
        parts = (step.forward, step.backward) if isinstance(step, Overlap) else (step,)
        for act, ms in zip(parts, t.part_ms or (t.compute_ms,)):
            acts[(act.op, act.stage)].append(ms)
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    out = {}
    for s, plan in plans.items():
        layers, nodes = [], []
        for layer in plan:
            key = layer[0].layer
            ms = {f"{side}.{n.name}": med(list(a2a[(side, key, n.name)].values())) if n.comm is not None
                  else med(per[(side, key, n.name)]) for side in "FB" for n in layer}
            moe = any(n.comm is not None for n in layer)
            nodes.append(ms if moe else {})
            side = [(med(per[(x, key, "")]), med(list(a2a[(x, key, "")].values()))) for x in "FB"]
            layers.append((*side[0], *side[1], 0.0) if moe else (0.0,) * 5)
        out[str(s)] = {"f": med(acts[(Op.F, s)]), "b": med(acts[(Op.B, s)]), "w": med(acts[(Op.W, s)]),
                       "bw": med(acts[(Op.BW, s)]), "layers": layers, "nodes": nodes}
    return out


def _pair_order() -> list[tuple[str, str]]:
    """The executor's issue order of an MoE layer pair (runtime/overlap.py fb_order) as (side, node)."""
    from pipetrain.runtime.overlap import fb_order
    from pipetrain.runtime.stage_protocol import Node

    f = [[(Node(n, "f", (), ()), ("F", n)) for n in _MOE_F]]
    b = [[(Node(n, "b", (), ()), ("B", n)) for n in _MOE_F[::-1]]]
    return [tag for _, tag in fb_order(f, b)]  # type: ignore[arg-type]


def chain_ms(order: list[tuple[str, str]], ms: dict[str, float]) -> float:
    """An MoE layer pair run in `order` on one thread: a compute node starts when the thread is free and
    its side's last all-to-all has arrived; an all-to-all takes its measured time from its start, in
    flight beside any other (the delay, or gloo's worker threads)."""
    t, arrives = 0.0, {"F": 0.0, "B": 0.0}
    for side, name in order:
        if name in ("dispatch", "combine"):
            arrives[side] = t + ms[f"{side}.{name}"]
        else:
            t = max(t, arrives[side]) + ms[f"{side}.{name}"]
    return max(t, *arrives.values())


@dataclass(frozen=True)
class ChainCosts(StageCosts):
    """StageCosts whose F&B pairs save, per MoE layer pair, its serial time less `chain_ms` (the
    executor's node order with concurrent all-to-alls) instead of min(compute, all-to-all)."""

    nodes: tuple = ()  # per stage, per layer: {"F.attn": ms, ..., "B.dispatch": ms} ({} : no all-to-all)
    order: tuple = ()

    def hidden(self, forward: Action, backward: Action) -> float:
        fwd, bwd = self.nodes[forward.stage], self.nodes[backward.stage][::-1]
        return sum(sum(f[k] for k in f if k[0] == "F") + sum(b[k] for k in b if k[0] == "B")
                   - chain_ms(list(self.order), {**f, **b}) for f, b in zip(fwd, bwd) if f and b)


def simulated(raw: dict, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The simulator's step and per-rank F&B ms for dualpipev with the overlap model (on) and without
    (serial), from the serial row's costs: per stage the mean over its EP ranks of the medians over steps."""
    from pipetrain.schedules import registry

    per_stage: dict[int, list[dict]] = defaultdict(list)
    for ranks in raw["ranks"]:
        for rec in ranks["dualpipev_serial"]:
            for s, c in rec["costs"].items():
                per_stage[int(s)].append(c)
    sched = registry.build("dualpipev", args.pp, args.microbatches, 2)
    n = sched.placement.num_stages
    if sorted(per_stage) != list(range(n)):
        return None
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    agg = {k: tuple(mean([c[k] for c in per_stage[s]]) for s in range(n)) for k in ("f", "b", "w", "bw")}
    layers = tuple(tuple(tuple(mean([c["layers"][i][j] for c in per_stage[s]]) for j in range(5))
                         for i in range(len(per_stage[s][0]["layers"]))) for s in range(n))
    nodes = tuple(tuple({k: mean([c["nodes"][i][k] for c in per_stage[s]]) for k in per_stage[s][0]["nodes"][i]}
                        for i in range(len(layers[s]))) for s in range(n))
    out: dict[str, Any] = {"stage_costs": {**agg, "layers": layers, "nodes": nodes}}
    chain = ChainCosts(agg["f"], agg["b"], agg["w"], agg["bw"], layers, nodes=nodes, order=tuple(_pair_order()))
    for mode, costs in (("on", StageCosts(agg["f"], agg["b"], agg["w"], agg["bw"], layers)),
                        ("serial", StageCosts(agg["f"], agg["b"], agg["w"], agg["bw"])), ("chain", chain)):
        fb = [sum(costs.step(st) for st in sched.steps[r] if isinstance(st, Overlap)) for r in range(sched.num_ranks)]
        out[f"fb_ms_{mode}"] = mean(fb)
        out[f"step_ms_{mode}"] = simulate(sched, costs).makespan
    return out
