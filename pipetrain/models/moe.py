"""A Mixture-of-Experts layer: router, routed experts, shared experts. Its maths are plain torch;
under expert parallel its experts declare the group they hold a block of (`Experts.ep_group`, set by
parallel/ep.py) and their forward goes through runtime/ep_comm.py's dispatch and combine.

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
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config.moe import MoEConfig
from pipetrain.models.moe_router import Router, Routing, balance_loss, capacity, tokens_per_expert, within_capacity
from pipetrain.runtime import ep_comm
from pipetrain.runtime.ep_comm import EPGroup


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


class Assignment(NamedTuple):
    """A layer's routing of its tokens (MoE.assign): scores and choices, demand, dropped share, order."""

    routing: Routing
    counts: torch.Tensor  # (E,) int64 assignments per expert before any drop
    dropped: torch.Tensor  # () share of assignments over capacity
    d: Dispatch


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

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, H) sorted by global expert, counts (E,) -> (N, H) in x's order: this module's experts,
        or under expert parallel dispatch -> this rank's experts -> combine (node-level execution runs
        the same pieces as nodes of their own: models/moe_nodes.py)."""
        if self.ep_group is None:
            return self.local_forward(x, counts)
        rows, local_counts, routed = ep_comm.dispatch(x, counts, self.ep_group)
        return ep_comm.combine(self.local_forward(rows, local_counts), routed, self.ep_group)

    def local_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This module's own experts on x (N, H) sorted by its expert, counts per its expert -> (N, H)."""
        if self.impl == "grouped":
            return self.forward_grouped(x, counts)
        return self.forward_loop(x, counts)

    def forward_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference: one matmul chain per expert over its contiguous rows (a host sync for the
        counts, fine on CPU). An expert without tokens still runs (0 rows): the output stays in the
        graph even when no token comes, so under expert parallel every rank's backward issues the
        same reverse all-to-alls, and every microbatch builds the same graph."""
        outs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):  # rows (n_e, H), n_e may be 0
            h = F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e])  # (n_e, I)
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
        return F.grouped_mm(F.silu(gate) * up, w2, offs=offs)  # (N, H)


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
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (T, H) -> (T, I) -> (T, H)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


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
        self.shared_experts: Optional[SharedExperts] = None
        if config.num_shared_experts:
            width = shared_intermediate or config.num_shared_experts * intermediate
            self.shared_experts = SharedExperts(hidden=hidden, intermediate=width, gated=config.shared_gate)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        flat = x.reshape(-1, x.shape[-1])  # (T, H), T = B x seq
        a = self.assign(flat)
        y = self.experts(flat[a.d.tokens], a.d.counts)  # (N, H) expert-major
        out = self.gather(y, a, a.routing.gates, flat, x)
        return MoEOutput(out, self.aux_loss(a.routing, x), a.counts, a.dropped)

    def assign(self, flat: torch.Tensor) -> "Assignment":
        """Route the (T, H) tokens: top-k, capacity, the expert-major order (the first half of forward;
        node-level execution runs the halves as separate nodes around the experts)."""
        c = self.config
        routing = self.router(flat)
        counts = tokens_per_expert(routing.ids, c.num_experts)  # (E,) demand, before any drop
        cap = capacity(c, flat.shape[0])
        keep = None if cap is None else within_capacity(routing.ids, routing.gates, num_experts=c.num_experts,
                                                         cap=cap)
        dropped = torch.zeros((), device=flat.device) if keep is None else 1.0 - keep.float().mean()
        return Assignment(routing, counts, dropped, dispatch(routing.ids, keep, c.num_experts))

    def gather(self, y: torch.Tensor, a: "Assignment", gates: torch.Tensor, flat: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
        """The experts' rows y (N, H) expert-major -> the layer output, x's shape and dtype: gated, summed
        over k, plus the shared experts of `flat` (the second half of forward)."""
        y = y.to(gates.dtype) * gates.reshape(-1)[a.d.slots].unsqueeze(-1)  # gates in fp32+
        # Back to (token, k) order, then a sum over k: no atomics, the same bits on CPU and CUDA.
        full = y.new_zeros(gates.numel(), y.shape[1]).index_copy(0, a.d.slots, y)  # (T K, H), dropped: 0
        out = full.view(*gates.shape, -1).sum(1)  # (T, H)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.to(x.dtype).view(x.shape)

    def aux_loss(self, routing: Routing, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.balance not in ("aux_loss", "seq_aux_loss"):
            return torch.zeros((), device=x.device)
        seq_len = x.shape[-2] if c.balance == "seq_aux_loss" and x.dim() == 3 else None
        return c.aux_loss_coef * balance_loss(routing.scores, routing.ids, score_func=c.score_func, seq_len=seq_len)
