"""A Mixture-of-Experts layer: router, routed experts, shared experts. Its maths are plain torch;
under expert parallel its experts declare the group they hold a block of (`Experts.ep_group`, set by
parallel/ep.py) and the layer sends each row to the rank holding its expert and back.

    out = sum_{e in top-k(x)} gate_e(x) * expert_e(x)  [+ sigmoid(x w_s) *] shared(x)

with SwiGLU experts expert_e(x) = w2_e (silu(w1_e x) * w3_e x) (Shazeer 2020), stored stacked:
`w1`, `w3` (E, I, H) and `w2` (E, H, I), nn.Linear's (out, in) order per expert, so transformers
5's fused `gate_up_proj` (E, 2I, H) is cat([w1, w3], 1) and its `down_proj` (E, H, I) is w2, and the
hub's per-expert `experts.j.{gate,up,down}_proj.weight` are w1[j], w3[j], w2[j] (no transpose).
Shared experts are one SwiGLU MLP of num_shared_experts x I (DeepSeek's `shared_experts`,
Qwen2-MoE's `shared_expert` with `shared_expert_gate`).

Token order is deterministic: assignments are stable-sorted by expert id, so each expert sees its
tokens in token order; the weighted outputs are put back in (token, k) order and summed over k.
Routing maths, balancing and capacity: moe_router.py; the knobs: pipetrain/config/moe.py.

The forward is one ordered list of phases (`MoE.phases`, the one place it is composed), each a plain
function of named values, named as the nodes they become (schedules/fb_pairs.py):

  attn      route: (B, T, H) h -> rows xs (N, H) expert-major, gates (T, K), flat (T, H), aux (), and
            the Plan (no gradient in it); under expert parallel the counts exchange (ep_comm.exchange)
  dispatch  ep only: all-to-all of xs to the ranks holding their experts (received by source rank)
  experts   this rank's experts on xs by local expert (ep: ep_comm.expert_major, then source_major back)
  combine   ep only: the reverse all-to-all, rows ys (N, H) home in xs's order
  post      gather: gates, sum over top-k, shared experts of flat -> out, h's shape

Whole-stage execution (`MoE.forward`, `run_whole`) runs them in order, each all-to-all started and
waited at once (ep_comm.all_to_all, autograd's backward the reverse); node execution
(models/moe_nodes.py) runs the very same list as Nodes, the block's attention before attn and its
residual after post, each all-to-all started async (runtime/nodes.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config.moe import MoEConfig
from pipetrain.models.moe_router import Router, Routing, balance_loss, capacity, tokens_per_expert, within_capacity
from pipetrain.runtime.ep_comm import EPGroup, Routed, all_to_all, exchange, expert_major, source_major
from pipetrain.runtime.stage_protocol import Node
from pipetrain.schedules.fb_pairs import ATTN, COMBINE, DISPATCH, EXPERTS, POST


class MoEOutput(NamedTuple):
    out: torch.Tensor  # the layer's output, x's shape and dtype
    aux_loss: torch.Tensor  # () aux_loss_coef x balance loss under balance=aux_loss|seq_aux_loss, else 0: add it
    tokens_per_expert: torch.Tensor  # (E,) int64 routed assignments before any drop (aux_free's counts)
    dropped_fraction: torch.Tensor  # () fp32 share of the T K assignments over capacity (0 when dropless)


class Dispatch(NamedTuple):
    """Which assignment goes where: `tokens` (N,) the token of each kept assignment in expert-major
    order, `slots` (N,) its index into the flattened (T K) gates, `counts` (E,) per expert."""

    tokens: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor


def dispatch(ids: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int) -> Dispatch:
    """Stable sort of the (T, K) assignments by expert id; dropped ones (keep False) sort last, cut off."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # (T K,)
    if keep is not None:
        flat = flat.masked_fill(~keep.reshape(-1), num_experts)  # sentinel expert E: after every real one
    slots = torch.argsort(flat, stable=True)
    counts = tokens_per_expert(flat, num_experts + 1)[:num_experts]  # the sentinel's count cut off
    if keep is not None:
        slots = slots[: int(keep.sum())]
    return Dispatch(slots // k, slots, counts)


class Plan(NamedTuple):
    """What route tells the later phases of one forward; no tensor of it needs a gradient, so node
    execution hands it from node to node as it is (gates, flat and aux travel as values of their own)."""

    d: Dispatch  # this rank's kept assignments in expert-major order
    counts: torch.Tensor  # (E,) int64 assignments per expert before any drop
    dropped: torch.Tensor  # () share of assignments over capacity
    local_counts: torch.Tensor  # rows per expert this rank runs: d.counts, or (E/ep,) received under ep
    routed: Optional[Routed]  # expert parallel: the all-to-alls' splits, the received rows' expert-major order
    shape: torch.Size  # the layer input's: (B, T, H) or (T, H)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights; `forward` runs them over expert-major sorted tokens."""

    def __init__(self, num_experts: int, *, hidden: int, intermediate: int, impl: str = "loop") -> None:
        super().__init__()
        if impl == "grouped" and (hidden % 8 or intermediate % 8):  # grouped_mm: rows of 16-byte multiples
            raise ValueError(f"model.moe.experts_impl=grouped needs hidden ({hidden}) and expert width "
                             f"({intermediate}) divisible by 8: use experts_impl=loop")
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))  # gate_proj per expert
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))  # up_proj
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # down_proj
        # Expert parallel (parallel/ep.py: shard_experts): the group this module holds a block of the
        # E experts over (its w1, w2, w3 are that block's rows, under the unsplit names); None: all E.
        self.ep_group: Optional[EPGroup] = None
        # Expert tensor parallel (parallel/tp.py split_experts): this rank holds 1/tp of every expert's width
        # (rows of w1, w3, columns of w2); (enter, leave) bring its rows into the tp region (backward: summed
        # over tp) and sum its partial outputs over tp. None: whole experts.
        self.tp_region: Optional[tuple[Callable[[torch.Tensor], torch.Tensor],
                                       Callable[[torch.Tensor], torch.Tensor]]] = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This module's experts on x (N, H) sorted by its expert, counts per its expert -> (N, H) in x's
        order. Under expert parallel the layer's phases bring this rank's rows here and take them home
        (MoE.phases)."""
        enter, leave = self.tp_region or (None, None)
        if enter is not None:
            x = enter(x)
        y = self.forward_grouped(x, counts) if self.impl == "grouped" else self.forward_loop(x, counts)
        return y if leave is None else leave(y)

    def forward_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference: one matmul chain per expert over its contiguous rows (a host sync for the
        counts, fine on CPU). An expert without tokens still runs (0 rows): the output stays in the
        graph even when no token comes, so under expert parallel every rank's backward issues the
        same reverse all-to-alls, and every microbatch builds the same graph."""
        outs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):  # rows (n_e, H), n_e may be 0
            h = self.act(F.linear(rows, self.w1[e]), F.linear(rows, self.w3[e]))  # (n_e, I)
            outs.append(F.linear(h, self.w2[e]))  # (n_e, H)
        return torch.cat(outs)

    def forward_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The hook for the grouped-GEMM CUDA path: three `F.grouped_mm` calls with int32 end offsets,
        no host sync. Checked equal to the loop on CPU (ATen's fallback, which needs H and I rows
        aligned to 16 bytes) in tests/test_moe_layer.py; its CUDA speed and numerics are checked only in
        the gpu tier (test_grouped_experts_on_cuda), not in this CPU-only suite. autocast does not cast
        grouped_mm's operands (CUDA's kernel takes bf16 only): under trainer.precision=bf16 the rows and
        the fp32 weights go to autocast's dtype here, as autocast does for a matmul; else to the rows'."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        w1, w2, w3 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,) end row of each expert
        gate = F.grouped_mm(x, w1, offs=offs)  # (N, I)
        up = F.grouped_mm(x, w3, offs=offs)  # (N, I)
        return F.grouped_mm(self.act(gate, up), w2, offs=offs)  # (N, H)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The experts' SwiGLU activation (selective recompute's "moe_act"): (N, I) twice -> (N, I)."""
        return F.silu(gate) * up


class SharedExperts(nn.Module):
    """Experts every token goes through, fused into one SwiGLU MLP (HF's names), optionally scaled by
    sigmoid(gate(x)) per token (Qwen2-MoE's `shared_expert_gate`, a (1, H) weight)."""

    def __init__(self, *, hidden: int, intermediate: int, gated: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # (T, H) -> (T, I) -> (T, H)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation (selective recompute's "mlp_act"): (T, I) twice -> (T, I)."""
        return F.silu(gate) * up


class MoE(nn.Module):
    """The layer a block calls in place of its MLP: `forward(x)` with x (B, T, H) or (T, H) returns an
    MoEOutput. `intermediate` is one routed expert's width (HF `moe_intermediate_size`, Mixtral's
    `intermediate_size`); `shared_intermediate` the shared MLP's (default num_shared_experts x
    intermediate, DeepSeek's rule; Qwen2-MoE names its own `shared_expert_intermediate_size`).
    balance=seq_aux_loss takes each row of a (B, T, H) input as a sequence; a (T, H) input is one."""

    def __init__(self, config: MoEConfig, *, hidden: int, intermediate: int,
                 shared_intermediate: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        self.router = Router(config, hidden=hidden)
        self.experts = Experts(config.num_experts, hidden=hidden, intermediate=intermediate,
                               impl=config.experts_impl)
        # Context parallel (parallel/cp.py, through the block's cp_plan): the cp group this rank holds 1/cp of
        # each sequence's positions of; the balance loss counts over the whole sequences. None: all here.
        self.context: Optional[Any] = None
        # Experts whole over tp ranks that hold the same tokens (parallel/tp.py split_tokens, parallel.etp = 1):
        # (tp rank, tp, enter, sum): this rank dispatches tokens [rank T/tp, (rank+1) T/tp); None: all of them.
        self.tp_tokens: Optional[tuple[int, int, Callable[[torch.Tensor], torch.Tensor],
                                       Callable[[torch.Tensor], torch.Tensor]]] = None
        # Sequence parallel (etp = 1): each tp rank holds and dispatches its own 1/tp of the positions; (sum over
        # the tp group, tp): the balance loss counts over the whole sequences, as under context parallel.
        self.tp_sequence: Optional[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = None
        self.shared_experts: Optional[SharedExperts] = None
        if config.num_shared_experts:
            width = shared_intermediate or config.num_shared_experts * intermediate
            self.shared_experts = SharedExperts(hidden=hidden, intermediate=width, gated=config.shared_gate)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        env = run_whole(self.phases(), {"h": x})
        plan = env["plan"]
        return MoEOutput(env["out"], env["aux"], plan.counts, plan.dropped)

    def phases(self, layer: str = "", *, hooks: bool = True) -> list[Node]:
        """The forward as one ordered list of phases (module docstring), reading "h" and writing "out".
        `layer`: the nodes' layer key (node execution). `hooks`: call the experts module, running its
        forward hooks (whole stages: FSDP2 all-gathers the experts there), else its forward alone (node
        execution calls no hook: the executor's reducer gathers, parallel/fsdp.py FsdpReduce.gather)."""
        g = self.experts.ep_group
        call = self.experts if hooks else self.experts.forward

        def experts(xs: torch.Tensor, plan: Plan) -> tuple[torch.Tensor]:
            return (self.run_experts(call, xs, plan),)

        def post(ys: torch.Tensor, gates: torch.Tensor, flat: torch.Tensor, aux: torch.Tensor,
                 plan: Plan) -> tuple[torch.Tensor]:
            return (self.gather(ys, gates, flat, aux, plan),)

        # named as the nodes they become in a block (schedules/fb_pairs.py): its attention joins route in
        # the attn node, its residual gather in the post node (models/moe_nodes.py)
        route = Node(ATTN, layer, ("h",), ("xs", "gates", "flat", "aux", "plan"), fn=self.route,
                     modules=(self.router,))
        work = Node(EXPERTS, layer, ("xs", "plan"), ("ys",), fn=experts, modules=(self.experts,))
        shared = () if self.shared_experts is None else (self.shared_experts,)
        gather = Node(POST, layer, ("ys", "gates", "flat", "aux", "plan"), ("out",), fn=post, modules=shared)
        if g is None:
            return [route, work, gather]
        there = Node(DISPATCH, layer, ("xs",), ("xs",), comm=_splits(g, back=False))
        back = Node(COMBINE, layer, ("ys",), ("ys",), comm=_splits(g, back=True))
        return [route, there, work, back, gather]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Plan]:
        """h (B, T, H) or (T, H) -> (xs (N, H) the kept rows expert-major, gates (T, K), flat (T, H), aux (),
        the Plan): top-k, capacity, the expert-major order, the balance loss and, under expert parallel,
        the counts exchange (blocking: the splits are host values)."""
        c = self.config
        flat = h.reshape(-1, h.shape[-1])  # (T, H), T = B x seq
        routing = self.router(flat)
        counts = tokens_per_expert(routing.ids, c.num_experts)  # (E,) demand, before any drop
        cap = capacity(c, flat.shape[0])
        keep = None if cap is None else within_capacity(routing.ids, routing.gates, num_experts=c.num_experts,
                                                         cap=cap)
        dropped = torch.zeros((), device=flat.device) if keep is None else 1.0 - keep.float().mean()
        rows = flat
        if self.tp_tokens is not None:  # this tp rank's share of the tokens every tp rank routed alike
            rank, size, enter, _ = self.tp_tokens
            t = flat.shape[0]
            share = (torch.arange(t, device=flat.device) * size // t == rank).unsqueeze(1).expand_as(routing.ids)
            keep, rows = (share if keep is None else keep & share), enter(flat)
        d = dispatch(routing.ids, keep, c.num_experts)
        aux = self.aux_loss(routing, h)
        g = self.experts.ep_group
        local_counts, routed = (d.counts, None) if g is None else exchange(d.counts, g, flat.device)
        plan = Plan(d, counts, dropped, local_counts, routed, h.shape)
        return rows[d.tokens], routing.gates, flat, aux, plan

    @staticmethod
    def run_experts(call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: torch.Tensor,
                    plan: Plan) -> torch.Tensor:
        """The rows this rank holds (M, H) -> the experts' rows in the same order. Under expert parallel
        they come by source rank: to local-expert-major order for the experts and back."""
        if plan.routed is None:
            return call(xs, plan.local_counts)
        return source_major(call(expert_major(xs, plan.routed), plan.local_counts), plan.routed)

    def gather(self, ys: torch.Tensor, gates: torch.Tensor, flat: torch.Tensor, aux: torch.Tensor,
               plan: Plan) -> torch.Tensor:
        """The experts' rows ys (N, H) expert-major -> the layer output, h's shape and dtype: gated, summed
        over k, plus the shared experts of `flat`. `aux` is MoEBlock's (it attaches the balance loss)."""
        slots = plan.d.slots
        if self.tp_tokens is None:
            y = ys.to(gates.dtype) * gates.reshape(-1)[slots].unsqueeze(-1)  # gates in fp32+
            # Back to (token, k) order, then a sum over k: no atomics, the same bits on CPU and CUDA.
            full = y.new_zeros(gates.numel(), y.shape[1]).index_copy(0, slots, y)  # (T K, H), dropped: 0
        else:  # each tp rank's share in place, summed: every token's rows on every tp rank, then every gate
            y = ys.to(gates.dtype)
            full = self.tp_tokens[3](y.new_zeros(gates.numel(), y.shape[1]).index_copy(0, slots, y))
            full = full * gates.reshape(-1).unsqueeze(-1)  # (T K, H): the same products, dropped rows 0
        out = full.view(*gates.shape, -1).sum(1)  # (T, H)
        if self.shared_experts is not None:  # in h's shape: under sequence parallel its tp region gathers on T
            out = out + self.shared_experts(flat.view(plan.shape)).reshape(flat.shape)
        return out.to(flat.dtype).view(plan.shape)

    def aux_loss(self, routing: Routing, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.balance not in ("aux_loss", "seq_aux_loss"):
            return torch.zeros((), device=x.device)
        seq_len = x.shape[-2] if c.balance == "seq_aux_loss" and x.dim() == 3 else None
        sums = [s for s in (None if self.context is None else (self.context.sum_counts, self.context.g.size),
                            self.tp_sequence) if s is not None]  # the groups holding other positions of the sequences
        whole = None if not sums else (lambda counts: functools.reduce(lambda c, s: s[0](c), sums, counts),
                                       math.prod(s[1] for s in sums))
        return c.aux_loss_coef * balance_loss(routing.scores, routing.ids, score_func=c.score_func, seq_len=seq_len,
                                              whole=whole)


def _splits(g: EPGroup, *, back: bool) -> Callable[[Mapping[str, Any]], tuple[list[int], list[int], EPGroup]]:
    """A comm phase's (out_splits, in_splits, group) from route's plan: dispatch receives `recv` rows from
    each rank and sends `send`; combine (`back`) the reverse."""
    def of(env: Mapping[str, Any]) -> tuple[list[int], list[int], EPGroup]:
        r = env["plan"].routed
        return (r.send, r.recv, g) if back else (r.recv, r.send, g)
    return of


def run_whole(phases: list[Node], env: dict[str, Any]) -> dict[str, Any]:
    """Whole-stage execution of phases: in order over `env` (name -> value), each all-to-all started and
    waited at once (ep_comm.all_to_all: its backward the reverse all-to-all). Returns `env`."""
    for p in phases:
        if p.comm is not None:
            out_splits, in_splits, g = p.comm(env)
            env[p.writes[0]] = all_to_all(env[p.reads[0]], out_splits, in_splits, g, p.name)
        else:
            assert p.fn is not None, f"phase {p.name} has neither fn nor comm"
            env.update(zip(p.writes, p.fn(*(env[r] for r in p.reads))))
    return env
