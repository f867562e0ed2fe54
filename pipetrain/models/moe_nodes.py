"""A decoder block's forward as nodes (runtime/stage_protocol.py: Node), for node-level execution.

DualPipe's F&B overlap (issue #29; design note C4.1) interleaves the nodes of one microbatch's forward
with those of another's backward so the expert-parallel all-to-alls of one run under the other's
compute. An MoE block under expert parallel is five nodes, in Megatron's order with its combine split:

  attn      norm, attention, residual, pre-MoE norm, then the MoE's route (router, expert-major order,
            counts exchange)
  dispatch  all-to-all of the sorted rows to the ranks holding their experts (comm)
  experts   this rank's experts on the rows, by local expert, and back to received order
  combine   the reverse all-to-all (comm)
  post      the MoE's gather (gates, sum over top-k, shared experts, balance loss attached), residual

Without expert parallel an MoE block is attn, experts, post (no comm); a dense block is one node.
The MoE's nodes are its phases (models/moe.py MoE.phases), the very list whole-stage execution runs:
this file only puts the block's attention before the first and its residual after the last.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from pipetrain.models.moe_block import MoEBlock
from pipetrain.runtime.stage_protocol import Node


def single_node(layer: nn.Module, key: str, name: str = "layer", *, docs: bool = False) -> list[Node]:
    """A layer run whole: one compute node from x to x (`docs`: reading the microbatch's documents too,
    parallel/layer_spec.py DocumentsPlanned; None without document masks, as the whole stage passes none)."""
    if docs:
        return [Node(name, key, ("x", "docs"), ("x",), modules=(layer,),
                     fn=lambda x, d: (layer(x) if d is None else layer(x, d),))]
    return [Node(name, key, ("x",), ("x",), fn=lambda x: (layer(x),), modules=(layer,))]


def block_nodes(mlp: MoEBlock, key: str, *, attend: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                attend_modules: tuple[nn.Module, ...]) -> list[Node]:
    """A pre-norm decoder block with an MoE MLP as nodes: x1 + mlp(h) where (x1, h) = attend(x, docs) (x1 the
    residual stream after attention, h its pre-MoE norm; docs the microbatch's documents or None;
    `attend_modules` hold attend's parameters)."""
    route, *middle, gather = mlp.phases(key, hooks=False)
    assert route.fn is not None and gather.fn is not None

    def attn(x: torch.Tensor, docs: object) -> tuple:
        x1, h = attend(x, docs)  # (B, T, H) each
        return (x1, *route.fn(h))

    def post(*values: object) -> tuple:  # gather's reads, then x1
        *reads, x1 = values
        (out,) = gather.fn(*reads)
        return (x1 + out,)

    return [dataclasses.replace(route, reads=("x", "docs"), writes=("x1", *route.writes), fn=attn,
                                modules=(*attend_modules, *route.modules)),
            *middle,
            dataclasses.replace(gather, reads=(*gather.reads, "x1"), writes=("x",), fn=post)]
