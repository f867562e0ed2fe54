"""A decoder block's forward as nodes (runtime/stage_protocol.py: Node), for node-level execution.

DualPipe's F&B overlap (issue #29; design note C4.1) interleaves the nodes of one microbatch's forward
with those of another's backward so the expert-parallel all-to-alls of one run under the other's
compute. An MoE block under expert parallel is five nodes, in Megatron's order with its combine split:

  attn      norm, attention, residual, pre-MoE norm, router, expert-major order, counts exchange
  dispatch  all-to-all of the sorted rows to the ranks holding their experts (comm)
  experts   this rank's experts on the rows, by local expert, and back to received order
  combine   the reverse all-to-all (comm)
  post      gates, sum over top-k, shared experts, balance loss attached, residual

Without expert parallel an MoE block is attn, experts, post (no comm); a dense block is one node.
The maths are MoE.assign / MoE.gather / MoEBlock.count / attach: the same functions the whole
forward runs, so node and whole-stage execution agree (to summation order of the gradients).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from pipetrain.models.moe_block import MoEBlock
from pipetrain.runtime.ep_comm import exchange, expert_major, source_major
from pipetrain.runtime.stage_protocol import Node
from pipetrain.schedules.fb_pairs import ATTN, COMBINE, DISPATCH, EXPERTS, POST


def single_node(layer: nn.Module, key: str, name: str = "layer") -> list[Node]:
    """A layer run whole: one compute node from x to x."""
    return [Node(name, key, ("x",), ("x",), fn=lambda x: (layer(x),), modules=(layer,))]


def block_nodes(block: nn.Module, key: str) -> list[Node]:
    """A pre-norm decoder block's nodes (models/llama.py DecoderLayer: input_layernorm, self_attn,
    post_attention_layernorm, mlp)."""
    mlp = block.mlp
    if not isinstance(mlp, MoEBlock):
        return single_node(block, key)
    ex = mlp.experts
    g = ex.ep_group  # the EP group its experts are a block of (models/moe.py Experts), None: all of them

    def attn(x: torch.Tensor) -> tuple:
        x1 = x + block.self_attn(block.input_layernorm(x))  # (B, T, H)
        h = block.post_attention_layernorm(x1)
        flat = h.reshape(-1, h.shape[-1])  # (T', H)
        a = mlp.assign(flat)
        aux = mlp.aux_loss(a.routing, h)
        mlp.count(a.counts, aux, a.dropped)
        routed = None if g is None else exchange(a.d.counts, g, flat.device)  # (local counts, Routed)
        return x1, flat[a.d.tokens], a.routing.gates, flat, aux, (a, routed)

    def experts(rows: torch.Tensor, info: tuple) -> tuple:
        a, routed = info
        if routed is None:
            return (ex.local_forward(rows, a.d.counts),)
        local_counts, r = routed
        return (source_major(ex.local_forward(expert_major(rows, r), local_counts), r),)

    def post(y: torch.Tensor, gates: torch.Tensor, flat: torch.Tensor, x1: torch.Tensor, aux: torch.Tensor,
             info: tuple) -> tuple:
        out = mlp.gather(y, info[0], gates, flat, flat).view(x1.shape)  # (T', H) -> (B, T, H)
        return (x1 + mlp.attach(out, aux),)

    def splits(forward: bool) -> Any:
        def of(env: Mapping[str, Any]) -> tuple[list[int], list[int], Any]:
            r = env["moe"][1][1]
            return (r.recv, r.send, g) if forward else (r.send, r.recv, g)
        return of

    nodes = [Node(ATTN, key, ("x",), ("x1", "xs", "gates", "flat", "aux", "moe"), fn=attn,
                  modules=(block.input_layernorm, block.self_attn, block.post_attention_layernorm, mlp.router))]
    if g is not None:
        nodes.append(Node(DISPATCH, key, ("xs",), ("xs",), comm=splits(True)))
    nodes.append(Node(EXPERTS, key, ("xs", "moe"), ("ys",), fn=experts, modules=(ex,)))
    if g is not None:
        nodes.append(Node(COMBINE, key, ("ys",), ("ys",), comm=splits(False)))
    shared = () if mlp.shared_experts is None else (mlp.shared_experts,)
    nodes.append(Node(POST, key, ("ys", "gates", "flat", "x1", "aux", "moe"), ("x",), fn=post,
                      modules=shared))
    return nodes
