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

`pipeline.fb_overlap` (config/__init__.py PipelineConfig): off (no nodes: the executor as before), auto
(nodes and overlap when every local stage has a node plan and one of them an all-to-all), on (the
same, refused in one line where impossible). The executor also takes `serial`: nodes, no interleave
(the reference the interleaved order is tested against, bitwise). On CUDA the all-to-alls run on a
communication stream of their own (one per rank, higher priority than the compute stream, as Megatron's
high-priority a2a stream), ordered by events (runtime/ep_comm.py); that needs more than one hardware queue,
so CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting for tensor-parallel overlap) leaves `auto` on whole
stages and refuses `on` in one line: one queue would run each all-to-all after the compute queued before it.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from pipetrain.config.cluster import ONE_QUEUE, one_hw_queue
from pipetrain.runtime.nodes import A2ALog, NodeBackward, NodeForward, Step
from pipetrain.runtime.stage_protocol import Node, OverlapStage
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
    """The node plans of a rank's stages, and how an F&B pair runs (interleaved or serial)."""

    def __init__(self, plans: Mapping[int, list[list[Node]]], *, interleave: bool,
                 timeout_s: Optional[float] = None, device: torch.device = torch.device("cpu")) -> None:
        self.plans, self.interleave = plans, interleave
        self.log = A2ALog(timeout_s)
        # CUDA: the all-to-alls' stream (priority -1: its kernels go first when both streams have work)
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None

    def forward(self, stage: int, microbatch: int, x: torch.Tensor, wrap: Callable) -> NodeForward:
        return NodeForward(self.plans[stage], stage, microbatch, x, self.log, wrap, self.stream)

    @staticmethod
    def run(steps: list[list[Step]]) -> None:
        for layer in steps:
            for _, step in layer:
                step()

    def pair(self, fwd: NodeForward, bwd: NodeBackward, forward_done: Callable[[], None]) -> None:
        """Both passes, interleaved; `forward_done` right after the forward's last node (its output
        goes to the next stage or the loss while the backward still runs)."""
        if not self.interleave:
            self.run(fwd.layers())
            forward_done()
            self.run(bwd.layers())
            return
        f_steps = fwd.layers()
        last = f_steps[-1][-1][1]  # the step, not the node: F and B of one stage share node objects
        for _, step in fb_order(f_steps, bwd.layers()):
            step()
            if step is last:
                forward_done()


def node_execution(stages: Mapping[int, object], fb_overlap: str, device: torch.device, *,
                   timeout_s: Optional[float] = None) -> Optional[NodeExecution]:
    """How a rank runs its stages under pipeline.fb_overlap (module docstring); None: whole stages."""
    if fb_overlap not in (*FB_OVERLAP, "serial"):
        raise ValueError(f"pipeline.fb_overlap must be {' or '.join(FB_OVERLAP)} (got {fb_overlap!r})")
    if fb_overlap == "off":
        return None
    plans = {s: st.fb_plan() if isinstance(st, OverlapStage) else None for s, st in stages.items()}
    missing = [s for s, p in plans.items() if p is None]
    a2a = any(n.comm is not None for p in plans.values() if p for layer in p for n in layer)
    one_queue = one_hw_queue(device.type)
    if fb_overlap == "auto" and (missing or not a2a or one_queue):
        return None
    if missing:
        raise ValueError(f"pipeline.fb_overlap={fb_overlap}: stage {missing[0]} cannot run node by node (activation "
                         f"recompute, or a model without node plans): set pipeline.fb_overlap=auto or off")
    if one_queue and fb_overlap == "on":
        raise ValueError(ONE_QUEUE)
    return NodeExecution({s: p for s, p in plans.items() if p is not None}, interleave=fb_overlap != "serial",
                         timeout_s=timeout_s, device=device)
