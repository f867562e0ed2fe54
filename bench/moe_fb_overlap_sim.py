"""bench/moe_fb_overlap.py's simulator check: measured per-node times -> the simulator's F&B overlap model
(schedules/simulate.py StageCosts.layers, schedules/fb_pairs.py) -> simulated F&B and step ms.

On the serial row (pipeline.fb_overlap=serial: every node run in order, every all-to-all waited by the
next node) each node is timed (`timed_nodes`), and the node log's spans give each all-to-all's time
from its start to its arrival; a node's compute is its time less the waits inside it. Per stage and
MoE layer (forward order) its nodes' ms (fb_pairs.LayerNodes), the median over microbatches; per stage
the actions' F, B, W and BW times as measured. The F&B pairs' backward here is BW, whose nodes also run
the weight gradients: the measured B nodes carry them and LayerNodes.w is 0. A layer without
all-to-alls saves nothing in a pair (the executor runs it serially): its nodes stay 0, the measured
action times carry it.

The simulator prices each MoE layer pair as the executor runs it (fb_pairs.chain_ms: the pair's nodes
in PAIR_ORDER on one thread, a compute node waiting for its own side's last all-to-all, two all-to-alls
in flight at once), so what is compared with the overlap row is the simulator itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any, Optional

from pipetrain.schedules.fb_pairs import MOE_NODES, LayerNodes, PassNodes
from pipetrain.schedules.ir import Op, Overlap
from pipetrain.schedules.simulate import StageCosts, simulate


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
            side = "B" if names == MOE_NODES[::-1] else "F"  # single-node layers: no all-to-all, side unused
            for node, step in layer:
                t0 = time.perf_counter()
                step()
                times.append((side, node.layer, node.name, t0, time.perf_counter()))

    nodes.run = run  # the instance's, before the class's staticmethod
    return times


def stage_costs(timings: list, log: Any, times: NodeTimes, plans: dict, steps: list) -> dict[str, Any]:
    """One serial step's costs per local stage: {stage: {f, b, w, bw, nodes}} (ms; medians over microbatches);
    nodes: per layer {"F.attn": ms, ..., "B.post": ms}, {} for a layer without all-to-alls."""
    waits = [(w, done) for _, _, w, done in log.spans]
    per: dict[tuple[str, str, str], list[float]] = defaultdict(list)  # (side, layer, node) -> ms per run
    bounds = times.calls + [len(times)]
    for a, b in zip(bounds, bounds[1:]):
        run: dict[tuple[str, str, str], float] = defaultdict(float)
        for side, layer, name, t0, t1 in times[a:b]:
            blocked = sum(max(0.0, min(t1, done) - max(t0, w)) for w, done in waits)
            run[(side, layer, name)] += 1e3 * (t1 - t0 - blocked)
        for key, ms in run.items():
            per[key].append(ms)
    a2a: dict[tuple[str, str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (side, _, mb, layer, name), (_, began, _, done) in zip(log.started, log.spans):
        a2a[(side, layer, name)][mb] += 1e3 * (done - began)
    acts: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for t in timings:
        step = steps[t.index]
        parts = (step.forward, step.backward) if isinstance(step, Overlap) else (step,)
        for act, ms in zip(parts, t.part_ms or (t.compute_ms,)):
            acts[(act.op, act.stage)].append(ms)
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    out = {}
    for s, plan in plans.items():
        nodes = []
        for layer in plan:
            key = layer[0].layer
            moe = any(n.comm is not None for n in layer)
            nodes.append({f"{side}.{n.name}": med(list(a2a[(side, key, n.name)].values())) if n.comm is not None
                          else med(per[(side, key, n.name)]) for side in "FB" for n in layer} if moe else {})
        out[str(s)] = {"f": med(acts[(Op.F, s)]), "b": med(acts[(Op.B, s)]), "w": med(acts[(Op.W, s)]),
                       "bw": med(acts[(Op.BW, s)]), "nodes": nodes}
    return out


def layer_nodes(ms: dict[str, float]) -> LayerNodes:
    """A layer's measured {"F.attn": ms, ...} as the simulator's LayerNodes (missing nodes 0; W inside B)."""
    return LayerNodes(*(PassNodes(*(ms.get(f"{side}.{n}", 0.0) for n in MOE_NODES)) for side in "FB"))


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
    nodes = tuple(tuple({k: mean([c["nodes"][i][k] for c in per_stage[s]]) for k in per_stage[s][0]["nodes"][i]}
                        for i in range(len(per_stage[s][0]["nodes"]))) for s in range(n))
    out: dict[str, Any] = {"stage_costs": {**agg, "nodes": nodes}}
    layers = tuple(tuple(layer_nodes(ms) for ms in stage) for stage in nodes)
    for mode, costs in (("on", StageCosts(agg["f"], agg["b"], agg["w"], agg["bw"], layers)),
                        ("serial", StageCosts(agg["f"], agg["b"], agg["w"], agg["bw"]))):
        fb = [sum(costs.step(st) for st in sched.steps[r] if isinstance(st, Overlap)) for r in range(sched.num_ranks)]
        out[f"fb_ms_{mode}"] = mean(fb)
        out[f"step_ms_{mode}"] = simulate(sched, costs).makespan
    return out
