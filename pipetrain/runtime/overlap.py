"""DualPipe's F&B overlap in one thread: a forward's nodes interleaved with another microbatch's backward.

For an F&B pair F(s_f, m_f) & B|BW(s_b, m_b) whose stages run node by node (runtime/nodes.py), the
forward's layers (ascending) are paired with the backward's (descending). An MoE pair under expert
parallel runs in schedules/fb_pairs.py's PAIR_ORDER (Megatron's, with its combine split in post and
combine; `↑` an all-to-all started, waited by the first node that reads its result):

  B.post  B.combine↑  F.attn  F.dispatch↑  B.experts  B.dispatch↑  F.experts  F.combine↑  B.attn  F.post

so each all-to-all has the other microbatch's compute to hide behind. Any other pair of layers (dense,
embedding, head) runs the forward layer then the backward one; unequal layer counts leave the rest of
the longer side to run serially at the end. The order is a pure function of the two node plans, so
every rank of an EP group, running the same schedule on the same stages, starts the same all-to-alls
in the same order (what gloo's tags and NCCL's per-communicator order need).

`pipeline.fb_overlap` (config/__init__.py PipelineConfig): off (whole stages: runtime/stage_passes.py), auto
(nodes and overlap when every local stage has a node plan and one of them an all-to-all), on (the
same, refused in one line where impossible). The executor also takes `serial`: nodes, no interleave
(the reference the interleaved order is tested against, bitwise). On CUDA the all-to-alls run on a
communication stream of their own (one per rank, higher priority than the compute stream, as Megatron's
high-priority a2a stream), ordered by events (runtime/ep_comm.py); that needs more than one hardware queue,
so CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting for tensor-parallel overlap) leaves `auto` on whole
stages and refuses `on` in one line: one queue would run each all-to-all after the compute queued before it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional

import torch

from pipetrain.config.cluster import ONE_QUEUE, one_hw_queue
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.nodes import A2ALog, NodeBackward, NodeForward, Step
from pipetrain.runtime.stage_passes import Grads, Head, StagePasses, WholeStages, Wrap
from pipetrain.runtime.stage_protocol import Node, OverlapStage, Stage
from pipetrain.schedules.fb_pairs import MOE_NODES, PAIR_ORDER

FB_OVERLAP = ("off", "auto", "on")


def fb_order(forward: list[list[Step]], backward: list[list[Step]]) -> list[Step]:
    """The interleaved issue order of one F&B pair (module docstring)."""
    order: list[Step] = []
    for f, b in zip(forward, backward):
        if tuple(n.name for n, _ in f) == MOE_NODES and tuple(n.name for n, _ in b) == MOE_NODES[::-1]:
            fi, bi = iter(f), iter(b)  # PAIR_ORDER takes each side's nodes in that side's run order
            order += [next(fi) if side == "F" else next(bi) for side, _ in PAIR_ORDER]
        else:
            order += f + b
    k = min(len(forward), len(backward))
    return order + [s for layer in forward[k:] for s in layer] + [s for layer in backward[k:] for s in layer]


class NodeExecution:
    """The node plans of a rank's stages, run as runtime/stage_passes.py's StagePasses: each pass node by
    node, and an F&B pair's two passes interleaved (`pair`) or one after the other (serial)."""

    def __init__(self, plans: Mapping[int, list[list[Node]]], *, interleave: bool,
                 timeout_s: Optional[float] = None, device: torch.device = torch.device("cpu")) -> None:
        self.plans, self.interleave = plans, interleave
        self.log = A2ALog(timeout_s)
        self._docs: Mapping[int, Documents] = {}
        # CUDA: the all-to-alls' stream (priority -1: its kernels go first when both streams have work)
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None

    def begin_step(self, reducer: Any, docs: Mapping[int, Documents]) -> None:
        self.log.begin_step()
        self._docs = docs  # the step's documents by microbatch (document masks; empty without)
        if reducer is not None:
            reducer.gather()  # nodes bypass the stage modules' forward hooks that would unshard FSDP2's parameters

    def forward(self, s: int, m: int, x: torch.Tensor, head: Head, wrap: Wrap) -> tuple[torch.Tensor, NodeForward]:
        run = self._start(s, m, x, wrap)
        self.run(run.layers())
        return self._head(run, head, wrap), run

    def backward(self, s: int, m: int, x: torch.Tensor, out: torch.Tensor, grad: Optional[torch.Tensor],
                 saved: NodeForward, *, split: bool) -> Grads:
        bwd = NodeBackward(saved, out, grad, split=split)
        self.run(bwd.layers())
        return bwd.input_grad(), bwd.works

    def pair(self, f: tuple[int, int, torch.Tensor], b: tuple[torch.Tensor, Optional[torch.Tensor], NodeForward], *,
             split: bool, head: Head, wrap: Wrap, forward_done: Callable[[torch.Tensor, NodeForward], None]) -> Grads:
        """F(f = stage, microbatch, input) and the backward of b = (output, its gradient, its forward's run), their
        nodes interleaved (fb_order) when `interleave`; `forward_done(output, run)` right after the forward's
        last node (its output goes to the next stage or the loss while the backward still runs)."""
        run = self._start(*f, wrap)
        bwd = NodeBackward(b[2], b[0], b[1], split=split)
        f_steps = run.layers()
        if not self.interleave:
            self.run(f_steps)
            forward_done(self._head(run, head, wrap), run)
            self.run(bwd.layers())
            return bwd.input_grad(), bwd.works
        last = f_steps[-1][-1][1]  # the step, not the node: F and B of one stage share node objects
        for _, step in fb_order(f_steps, bwd.layers()):
            step()
            if step is last:
                forward_done(self._head(run, head, wrap), run)
        return bwd.input_grad(), bwd.works

    def _start(self, s: int, m: int, x: torch.Tensor, wrap: Wrap) -> NodeForward:
        ctx = (lambda: wrap(s, m)) if wrap is not None else contextlib.nullcontext
        return NodeForward(self.plans[s], s, m, x, self.log, ctx, self.stream, docs=self._docs.get(m))

    @staticmethod
    def _head(run: NodeForward, head: Head, wrap: Wrap) -> torch.Tensor:
        """The executor's head (the loss on a chain's last stage) of the last node's output, in the pass's context."""
        out = run.output()
        with wrap(run.stage, run.microbatch) if wrap is not None else contextlib.nullcontext():
            return head(run.stage, run.microbatch, out)

    @staticmethod
    def run(steps: list[list[Step]]) -> None:
        for layer in steps:
            for _, step in layer:
                step()


def stage_passes(stages: Mapping[int, Stage], fb_overlap: str, device: torch.device, *,
                 timeout_s: Optional[float] = None, pairs: bool = True) -> StagePasses:
    """How a rank runs its stages' passes under pipeline.fb_overlap (module docstring): node by node, or
    whole (WholeStages); `pairs`: whether the rank's list has an F&B pair to overlap in (auto runs a list
    without, 1F1B's or ZB's, on whole stages: no node overhead)."""
    if fb_overlap not in (*FB_OVERLAP, "serial"):
        raise ValueError(f"pipeline.fb_overlap must be {' or '.join(FB_OVERLAP)} (got {fb_overlap!r})")
    if fb_overlap == "off" or (fb_overlap == "auto" and not pairs):
        return WholeStages(stages)
    plans = {s: st.fb_plan() if isinstance(st, OverlapStage) else None for s, st in stages.items()}
    missing = [s for s, p in plans.items() if p is None]
    a2a = any(n.comm is not None for p in plans.values() if p for layer in p for n in layer)
    one_queue = one_hw_queue(device.type)
    if fb_overlap == "auto" and (missing or not a2a or one_queue):
        return WholeStages(stages)
    if missing:
        raise ValueError(f"pipeline.fb_overlap={fb_overlap}: stage {missing[0]} cannot run node by node (activation "
                         f"recompute, or a model without node plans): set pipeline.fb_overlap=auto or off")
    if one_queue and fb_overlap == "on":
        raise ValueError(ONE_QUEUE)
    return NodeExecution({s: p for s, p in plans.items() if p is not None}, interleave=fb_overlap != "serial",
                         timeout_s=timeout_s, device=device)
