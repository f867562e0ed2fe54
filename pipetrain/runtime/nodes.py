"""Node-level execution of a stage: one microbatch's forward and backward, one node at a time.

A stage that implements OverlapStage (runtime/stage_protocol.py) describes its forward as nodes
per layer. `NodeForward` runs each compute node on detached leaves of its floating inputs and keeps
(leaves, outputs) per node; `NodeBackward` runs the nodes in reverse, each from its outputs'
gradients to its leaves' through runtime/backward.py: `backward_input` (B: the weight-gradient
work of every node is kept for W) or `backward_full` (BW). Comm nodes start an all-to-all
(runtime/ep_comm.py `start`, async; on CUDA on a communication stream) and leave a `Started` in the
environment; the next node that reads it waits (on CUDA: the compute stream waits, the host does not).
Their backward is the reverse all-to-all of the gradient on the splits the forward used (no counts
exchange in backward). Every start is appended to `log` (the issue order every rank
of an EP group must share), with the time spent blocked in waits (the exposed all-to-all time).

Both passes expose `layers()`: per layer, its steps in run order (a backward's layers and nodes
reversed), so runtime/overlap.py can interleave a forward and a backward step by step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

import torch

from pipetrain.runtime import collectives
from pipetrain.runtime.backward import WeightGradWork, backward_full, backward_input
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.ep_comm import Started, start
from pipetrain.runtime.stage_protocol import Node

Step = tuple[Node, Callable[[], None]]


class A2ALog:
    """Every all-to-all a rank starts in a step, in order, and when: per all-to-all a span
    [label, started, waited from, arrived] (perf_counter seconds; label as "a2a:dispatch L3 mb5 F").
    `arrived` is when the wait returned: gloo reports completion only through wait, so `total` is an
    upper bound of the transfer and `exposed` (the time blocked in waits) is exact. On CUDA these are
    host times (a wait only queues a stream wait): there the GPU's own times are the step record's. In a
    measured step each also reaches the step's record on its clock (runtime/collectives.py: CUDA events
    on GPU, so `exposed` is the time the compute stream stalled; the trace, moe/a2a_*)."""

    def __init__(self, timeout_s: Optional[float] = None) -> None:
        self.timeout_s = timeout_s  # the longest wait for an all-to-all (None: the EP group's timeout)
        self.begin_step()

    def begin_step(self) -> None:
        self.started: list[tuple[str, int, int, str, str]] = []  # (F|B, stage, microbatch, layer, node)
        self.spans: list[list] = []
        self._marks: dict[int, int] = {}  # id(Started) in flight -> its start mark on the measured step's clock

    def start(self, side: str, stage: int, microbatch: int, node: Node, started: Started) -> Started:
        self.started.append((side, stage, microbatch, node.layer, node.name))
        now = time.perf_counter()
        started.span = [f"a2a:{node.name} L{node.layer} mb{microbatch} {side}", now, now, now]
        self.spans.append(started.span)
        tap = collectives.sink()
        if tap is not None:
            self._marks[id(started)] = tap.mark()
        return started

    def ready(self, value: Any) -> Any:
        """A value as a node reads it: an all-to-all's output once it has arrived."""
        if not isinstance(value, Started):
            return value
        t0 = time.perf_counter()
        tap = collectives.sink()
        waited = tap.mark() if tap is not None else 0
        out = value.wait(self.timeout_s)
        if value.span is not None:
            value.span[2:] = [t0, time.perf_counter()]
            if tap is not None and id(value) in self._marks:
                tap.collective("ep", value.span[0], out.nbytes, self._marks.pop(id(value)), waited)
            value.span = None
        return out

    def summary(self) -> dict[str, float]:
        """The step's all-to-all time in ms: total (start -> arrived), exposed (blocked in waits), and
        the share hidden under compute (issue #29's moe/a2a_ms, moe/a2a_exposed_ms, moe/a2a_overlap)."""
        total = 1e3 * sum(done - began for _, began, _, done in self.spans)
        exposed = 1e3 * sum(done - waited for _, _, waited, done in self.spans)
        return {"a2a_ms": total, "a2a_exposed_ms": exposed, "a2a_overlap": 1.0 - exposed / total if total else 0.0}


class NodeError(RuntimeError):
    """A node failed: names it (an expert-parallel peer that failed or went silent shows here)."""


@contextlib.contextmanager
def _named(side: str, stage: int, microbatch: int, node: Node) -> Iterator[None]:
    try:
        yield
    except NodeError:
        raise
    except Exception as e:
        raise NodeError(f"{side} of stage {stage} microbatch {microbatch}, layer {node.layer} node {node.name!r} "
                        f"failed: {type(e).__name__}: {e} (under expert parallel a peer that failed or stayed silent "
                        f"past pipeline.p2p_timeout_s shows here)") from e


def _leaf(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().requires_grad_(True)
    return v


class NodeForward:
    """One microbatch's forward through a stage's nodes; `saving` wraps each compute node (the
    recorder's saved-bytes hooks), `autocast` too."""

    def __init__(self, plan: list[list[Node]], stage: int, microbatch: int, x: torch.Tensor, log: A2ALog,
                 wrap: Callable[[], Any], stream: Optional[torch.cuda.Stream] = None, *,
                 docs: Optional[Documents] = None) -> None:
        self.plan, self.stage, self.microbatch, self.log, self.wrap = plan, stage, microbatch, log, wrap
        self.stream = stream  # CUDA: the communication stream its all-to-alls run on (runtime/ep_comm.py)
        # document masks: the microbatch's documents, their mask built once for the stage's nodes
        self.env: dict[str, Any] = {"x": x, "docs": None if docs is None else docs.with_mask()}
        # per node run: (node, its leaves, its outputs by name) or, for a comm node, (node, splits)
        self.records: list[tuple[Node, Any, Any]] = []

    def layers(self) -> list[list[Step]]:
        return [[(n, (lambda n=n: self.run(n))) for n in layer] for layer in self.plan]

    def run(self, node: Node) -> None:
        with _named("F", self.stage, self.microbatch, node):
            collectives.run_node(lambda: self._run(node), node.name, node.layer, self.microbatch, "F")

    def _run(self, node: Node) -> None:
        env = self.env
        if node.comm is not None:
            out_splits, in_splits, g = node.comm(env)
            x = self.log.ready(env[node.reads[0]])
            env[node.writes[0]] = self.log.start("F", self.stage, self.microbatch, node,
                                                 start(x.detach(), out_splits, in_splits, g, self.stream))
            self.records.append((node, (out_splits, in_splits, g), None))
            return
        leaves = [_leaf(self.log.ready(env[r])) for r in node.reads]
        with self.wrap():
            outs = node.fn(*leaves)  # type: ignore[misc]
        env.update(zip(node.writes, outs))
        self.records.append((node, leaves, dict(zip(node.writes, outs))))

    def output(self) -> torch.Tensor:
        return self.log.ready(self.env["x"])


class NodeBackward:
    """One microbatch's backward through the nodes its forward ran, from `final` (what the executor
    made of the last node's "x": the loss, or the output cast for the next stage) and its gradient
    (for a loss StepLoss.seed, 1/M; None: ones). `split`: B (weight gradients later, `works` for W) else BW."""

    def __init__(self, fwd: NodeForward, final: torch.Tensor, grad: Optional[torch.Tensor], *, split: bool) -> None:
        self.fwd, self.split, self.log = fwd, split, fwd.log
        node, leaves, outs = fwd.records[-1]
        fwd.records[-1] = (node, leaves, {**outs, "x": final})
        self.grads: dict[str, Any] = {"x": grad}
        self.works: list[WeightGradWork] = []
        fwd.env.clear()

    def layers(self) -> list[list[Step]]:
        by_layer: dict[str, list[Step]] = {}
        for rec in reversed(self.fwd.records):
            by_layer.setdefault(rec[0].layer, []).append((rec[0], (lambda rec=rec: self.run(rec))))
        return list(by_layer.values())

    def run(self, rec: tuple[Node, Any, Any]) -> None:
        with _named("B", self.fwd.stage, self.fwd.microbatch, rec[0]):
            collectives.run_node(lambda: self._run(rec), rec[0].name, rec[0].layer, self.fwd.microbatch, "B")

    def _run(self, rec: tuple[Node, Any, Any]) -> None:
        node, leaves, outs = rec
        grads, log = self.grads, self.log
        if node.comm is not None:  # the reverse all-to-all: splits swapped
            out_splits, in_splits, g = leaves
            gy = log.ready(grads.pop(node.writes[0]))
            grads[node.reads[0]] = log.start("B", self.fwd.stage, self.fwd.microbatch, node,
                                             start(gy, in_splits, out_splits, g, self.fwd.stream))
            return
        pairs = [(outs[w], log.ready(grads.pop(w))) for w in node.writes if w in grads]
        pairs = [(o, gr) for o, gr in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            return  # nothing flows back through this node (as in the whole-stage graph)
        ys, gys = [o for o, _ in pairs], [gr for _, gr in pairs]
        ins = [v for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad]
        if self.split:
            gxs, work = backward_input(ys, gys, ins, node.params())
            self.works.append(work)
        else:
            gxs = backward_full(ys, gys, ins, node.params())
        it = iter(gxs)
        for name, v in zip(node.reads, leaves):
            gx = next(it) if isinstance(v, torch.Tensor) and v.requires_grad else None
            if gx is not None:
                grads[name] = gx if name not in grads else log.ready(grads[name]) + gx

    def input_grad(self) -> Optional[torch.Tensor]:
        g = self.log.ready(self.grads.get("x"))
        self.fwd.records.clear()
        return g
