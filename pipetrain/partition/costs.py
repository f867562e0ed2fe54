"""Per-layer cost model shared by every model: what one layer costs for one microbatch.

Pure Python (no torch), so `mode=simulate` never needs torch.distributed or a device.
Times are per microbatch: f (forward), b (input-grad, B) and w (weight-grad, W) in ms. What expert
and context parallel do to one rank's layers (`ep_layer_costs`, `cp_layer_costs`) is here too;
tensor parallel's is schedules/tp_cost.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

def ms_from_flops(flops: float, tflops: float) -> float:
    """Milliseconds to execute `flops` at a sustained `tflops` (10^12 FLOP/s)."""
    if tflops <= 0:
        raise ValueError(f"tflops must be > 0 (got {tflops}): pass the device's sustained throughput")
    return flops / (tflops * 1e12) * 1e3


COLUMN, ROW, WHOLE = "col", "row", "whole"  # how tensor parallel splits a GEMM: its n, its k, or neither


@dataclass(frozen=True)
class LayerShape:
    """What one layer computes per token, by kind, so a device can time it (planner/compute.py): its GEMMs as
    (k, n, split) of x (1, k) @ W (k, n), split the tensor-parallel cut (COLUMN: n / tp, ROW: k / tp, WHOLE:
    replicated); its attention (query and K/V heads, head_dim; each query meets up to the sequence's keys); and the
    values its element-wise ops (activations and the loss's softmax, split by tp; norms and residual adds, whole
    unless sequence parallel) read and write in a forward."""

    gemms: tuple[tuple[int, int, str], ...] = ()
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    elementwise_values: float = 0.0  # per token, forward, of the values tp splits (the backward moves twice as many)
    elementwise_whole: float = 0.0  # likewise, of the values every tp rank keeps whole (norms, residual adds)


@dataclass(frozen=True)
class LayerCost:
    """One layer of a model, as the partitioner and the simulator see it."""

    name: str
    f_ms: float
    b_ms: float
    w_ms: float
    params: int = 0  # parameters stored by this layer (a tied copy counts where it is stored)
    flops_per_token: float = 0.0  # forward FLOPs per token (attention included)
    activation_bytes_per_token: int = 0  # bytes this layer keeps for its backward, per token
    # an MoE layer: of `params`, its routed experts' (expert parallel splits them over ep), and the
    # values per token its dispatch and combine all-to-alls carry in one pass (2 x top_k x hidden)
    experts_params: int = 0
    a2a_values_per_token: int = 0
    kv_values_per_token: int = 0  # attention: K and V values per token (kv heads x head_dim x 2), what cp gathers
    # of flops_per_token, the share its routed experts compute (the F&B overlap model's experts node,
    # schedules/fb_pairs.py LayerNodes.split); a share, not a count, so tp, cp and measured times keep it
    experts_flops_share: float = 0.0
    # likewise the share its shared experts compute (node execution runs them in the post node)
    shared_experts_flops_share: float = 0.0
    # of f_ms and b_ms, the expert-parallel all-to-all time (what an F&B pair's other half can hide)
    comm_f_ms: float = 0.0
    comm_b_ms: float = 0.0
    shape: Optional[LayerShape] = None  # what it computes, where a device times it (None: only its FLOPs are known)
    # selective recompute (trainer.recompute_modules): per module the layer has, (its name, the activation
    # bytes per token recomputing it saves, the forward FLOPs per token B runs again for it)
    recompute_modules: tuple[tuple[str, int, float], ...] = ()

    @property
    def total_ms(self) -> float:
        return self.f_ms + self.b_ms + self.w_ms

    def selective(self, modules: Sequence[str]) -> tuple[int, float]:
        """Under selective recompute of `modules` (those this layer has): (activation bytes per token it keeps,
        the ms B runs again, a share of f_ms by FLOPs)."""
        saved = [(b, f) for name, b, f in self.recompute_modules if name in modules]
        again = self.f_ms * sum(f for _, f in saved) / self.flops_per_token if self.flops_per_token else 0.0
        return self.activation_bytes_per_token - sum(b for b, _ in saved), again


def chunk_costs(layers: Sequence[LayerCost], bounds: Sequence[range]) -> list[tuple[float, float, float]]:
    """Sum layer costs over each chunk's layer range -> [(f, b, w)] per chunk."""
    # fsum: the same per-chunk totals whatever the layer order, so table and simulation agree exactly
    return [
        tuple(math.fsum(getattr(layers[i], key) for i in rng) for key in ("f_ms", "b_ms", "w_ms"))
        for rng in bounds
    ]


def link_ms(nbytes: float, bandwidth_gbs: float) -> float:
    """Milliseconds `nbytes` take at `bandwidth_gbs` GB/s (1e9 bytes)."""
    return nbytes / (bandwidth_gbs * 1e9) * 1e3


def splits(knob: str, degree: int, bandwidth_gbs: float) -> bool:
    """Whether parallel.<knob>=degree changes a rank's costs (degree > 1), its degree and link checked."""
    if degree < 1:
        raise ValueError(f"parallel.{knob} must be >= 1 (got {degree})")
    if degree > 1 and not bandwidth_gbs > 0:
        raise ValueError(f"cluster.{knob}_bandwidth_gbs must be > 0 GB/s (got {bandwidth_gbs})")
    return degree > 1


def a2a_bytes(layer: LayerCost, *, ep: int, tokens: int, bytes_per_value: int) -> float:
    """Bytes one rank sends in an MoE layer's all-to-alls in one pass (the forward's dispatch and
    combine, or the backward's two): tokens x top_k x hidden each way, of which (ep-1)/ep leave the rank
    (balanced routing; the rest stays local)."""
    return tokens * layer.a2a_values_per_token * bytes_per_value * (ep - 1) / ep


def ep_layer_costs(layers: Sequence[LayerCost], *, ep: int, tokens: int, bytes_per_value: int,
                   bandwidth_gbs: float) -> list[LayerCost]:
    """One expert-parallel rank's layers, `tokens` the tokens it dispatches (its 1/cp of the microbatch's, and
    1/tp of those where etp = 1: the tp ranks share their tokens, each dispatching its share): every MoE layer's
    F and B gain its all-to-all time (a2a_bytes over cluster.ep_bandwidth_gbs, also noted in comm_f_ms /
    comm_b_ms), and it stores 1/ep of its experts (tensor parallel then splits them by etp: schedules/tp_cost.py).
    Compute is unchanged: with balanced routing a rank's experts take as many token-expert rows as its tokens
    have choices (under tp, 1/tp of them at full width where etp = 1 or all at 1/tp of it: the same GEMM flops)."""
    if not splits("ep", ep, bandwidth_gbs):
        return list(layers)
    out = []
    for l in layers:
        t = link_ms(a2a_bytes(l, ep=ep, tokens=tokens, bytes_per_value=bytes_per_value), bandwidth_gbs)
        kept = -(-l.experts_params // ep)
        out.append(dataclasses.replace(l, f_ms=l.f_ms + t, b_ms=l.b_ms + t, comm_f_ms=l.comm_f_ms + t,
                                       comm_b_ms=l.comm_b_ms + t, params=l.params - l.experts_params + kept,
                                       experts_params=kept) if l.experts_params or t else l)
    return out


def cp_layer_costs(layers: Sequence[LayerCost], *, cp: int, tokens: int, bytes_per_value: int, bandwidth_gbs: float,
                   rotate: str = "allgather") -> list[LayerCost]:
    """One context-parallel rank's layers for a microbatch of `tokens` tokens, each rank holding 1/cp of
    every sequence (head-tail chunks balance the causal attention): F, B, W and the activations kept per
    token of the microbatch divide by cp. Attention's traffic per layer: the sequence's K and V, of which
    (cp-1)/cp come from the other ranks, gathered in F and their gradients reduce-scattered in B, over
    cluster.cp_bandwidth_gbs. allgather: both on the critical path, and the gathered K/V kept for the
    backward; ring: the same bytes in cp-1 steps, the first exposed and the others hidden behind the
    previous block's attention, and only the local K/V kept."""
    if not splits("cp", cp, bandwidth_gbs):
        return list(layers)
    out = []
    for l in layers:
        kv = tokens * l.kv_values_per_token * bytes_per_value * (cp - 1) / cp  # one rank's received K/V bytes
        t = link_ms(kv, bandwidth_gbs) / (cp - 1 if rotate == "ring" else 1)
        gathered = l.kv_values_per_token * bytes_per_value * (cp - 1) / cp if rotate == "allgather" else 0.0
        out.append(dataclasses.replace(
            l, f_ms=l.f_ms / cp + t, b_ms=l.b_ms / cp + t, w_ms=l.w_ms / cp, comm_f_ms=l.comm_f_ms / cp,
            comm_b_ms=l.comm_b_ms / cp, activation_bytes_per_token=l.activation_bytes_per_token / cp + gathered))
    return out
