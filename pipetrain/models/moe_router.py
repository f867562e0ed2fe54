"""The router of a Mixture-of-Experts layer and its balancing maths (pure torch, no torch.distributed).

Formulas, with T tokens, E experts, top-k K (pipetrain/config/moe.py says which model uses which):
  logits  = x W_g^T                        (T, E), in fp32 or wider whatever x's dtype
  scores  = softmax(logits) | sigmoid(logits)
  choice  = top-K of (scores + expert_bias), within the topk_group best groups when n_group > 1
            (a group scores as the sum of its two best biased scores: DeepSeek-V3's inference code;
            group_score=max: as its best score, DeepSeek-V2's group_limited_greedy)
  gates   = scores at the chosen ids (never the bias: DeepSeek-V3 §2.1.2, "the gating value is
            still derived from the original affinity"), / their sum if norm_topk_prob, x scale.

Balance: `balance_loss` is Switch / DeepSeek's E/(K T) sum_i count_i P_i (1.0 when perfectly even;
transformers' Mixtral `load_balancing_loss_func` is K times this), and `updated_expert_bias` is
DeepSeek-V3's aux-free rule bias_i += rate * sign(mean - count_i), called once per optimizer step.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config.moe import MoEConfig


class Routing(NamedTuple):
    """One forward's routing of T tokens (K chosen experts each, E experts)."""

    gates: torch.Tensor  # (T, K) weights of the chosen experts' outputs, fp32 or wider, with grad
    ids: torch.Tensor  # (T, K) int64 chosen experts
    scores: torch.Tensor  # (T, E) unbiased softmax / sigmoid scores, with grad (for the aux loss)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing runs in fp32 for bf16 inputs (DeepSeek, torchtitan) and in float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


class Router(nn.Module):
    """Token-choice top-k router: gate `weight` (E, H) as HF's `mlp.gate.weight`, and an fp32
    `expert_bias` (E,) that steers the choice only (HF DeepSeek-V3's `e_score_correction_bias`),
    saved with the weights, never trained by gradient."""

    def __init__(self, config: MoEConfig, *, hidden: int) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        # A parameter without gradient rather than a buffer: models built on the meta device are
        # materialized parameter by parameter from (seed, name) or a checkpoint (models/init.py), and
        # the optimizer skips it (no grad); the aux_free hook moves it (models/moe_block.py).
        self.expert_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        dtype = compute_dtype(x.dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))  # (T, E)
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()  # (T, E)
        if c.force_balanced:  # round-robin, as torchtitan's _debug_force_load_balance: counts equal to +-1
            ids = torch.arange(scores.numel() // c.num_experts * c.top_k, device=x.device).view(-1, c.top_k)
            ids = ids % c.num_experts  # (T, K)
        else:
            ids = choose(scores.detach() + self.expert_bias, top_k=c.top_k, n_group=c.n_group,
                         topk_group=c.topk_group, group_score=c.group_score)
        gates = scores.gather(1, ids)  # (T, K): unbiased
        if c.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)  # the 1e-20 of HF DeepSeek-V3
        return Routing(gates * c.routed_scaling_factor, ids, scores)


def choose(choice: torch.Tensor, *, top_k: int, n_group: int = 1, topk_group: int = 1,
           group_score: str = "top2") -> torch.Tensor:
    """Top-k expert ids (T, K) of `choice` (T, E), group-limited when n_group > 1. torch.topk is
    deterministic on CPU; ids come in descending score order."""
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)  # (T, G, E/G)
        # (T, G): sum of each group's best two (V3), or its best (V2)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if group_score == "top2" else grouped.amax(-1)
        best = group_scores.topk(topk_group, dim=-1).indices  # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        # -inf, not HF's 0.0: a negative bias could otherwise rank a masked expert above a kept one
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    return choice.topk(top_k, dim=-1).indices


def tokens_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many of the (T, K) assignments `ids` (ids < num_experts) went to each expert. A
    scatter-add, not torch.bincount, which reads the ids' max on the host first: on a GPU a sync per
    routing, which would stall node execution's overlap (runtime/ep_comm.py: one planned sync per dispatch)."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def balance_loss(scores: torch.Tensor, ids: torch.Tensor, *, score_func: str, seq_len: Optional[int] = None,
                 whole: Optional[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = None) -> torch.Tensor:
    """E/(K S) sum_i count_i P_i averaged over sequences of `seq_len` tokens (None: the whole batch
    is one sequence, Switch's aux loss; a length: DeepSeek-V3's sequence-wise loss, eq. 17-20).

    P_i is the mean over the sequence of the scores normalised over all experts (softmax scores
    already are; sigmoid ones are divided by their sum, as DeepSeek's s'). Gradient flows through
    P only (the counts are integers), i.e. into the router weight. scores (T, E), ids (T, K).

    Context parallel (`whole` = (sum over the cp group, cp)): this rank holds 1/cp of each sequence's
    positions; the counts are summed over the group into the whole sequences' (Megatron sums them over
    its tp x cp group the same way) and P stays this rank's mean, so the mean over the group of the
    ranks' losses is the whole sequences' loss, as each rank's cross-entropy is its share of the mean.
    """
    t, e = scores.shape
    k = ids.shape[1]
    s = t if seq_len is None else seq_len
    if t % s:
        raise ValueError(f"{t} routed tokens do not split into sequences of {s}: pass the layer (B, T, H) input")
    probs = scores if score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
    counts = torch.zeros(t // s, e, dtype=scores.dtype, device=scores.device)  # (B, E)
    counts.scatter_add_(1, ids.reshape(t // s, s * k), torch.ones_like(ids, dtype=scores.dtype).view(t // s, -1))
    parts = 1
    if whole is not None:
        counts, parts = whole[0](counts), whole[1]  # (B, E) of the whole sequences, s x parts tokens each
    f = counts * (e / (k * s * parts))  # (B, E): 1 each under perfect balance
    p = probs.view(t // s, s, e).mean(1)  # (B, E)
    return (f * p).sum(-1).mean()


def capacity(config: MoEConfig, tokens: int) -> Optional[int]:
    """Assignments one expert may take per forward: ceil(c T K / E) (GShard, Megatron); None: dropless."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * tokens * config.top_k / config.num_experts)


def within_capacity(ids: torch.Tensor, gates: torch.Tensor, *, num_experts: int, cap: int) -> torch.Tensor:
    """(T, K) bool: the assignments each expert keeps, its `cap` highest gates (Megatron's `probs`
    policy); equal gates go to the earlier token, so the drop is deterministic."""
    flat_ids, flat_gates = ids.reshape(-1), gates.detach().reshape(-1)  # (N,), N = T K
    by_gate = torch.argsort(-flat_gates, stable=True)
    order = by_gate[torch.argsort(flat_ids[by_gate], stable=True)]  # expert-major, gate descending
    counts = tokens_per_expert(flat_ids, num_experts)
    starts = torch.cumsum(counts, 0) - counts  # (E,) first position of each expert in `order`
    rank = torch.empty_like(flat_ids)
    rank[order] = torch.arange(flat_ids.numel(), device=ids.device) - starts[flat_ids[order]]
    return (rank < cap).view_as(ids)


@torch.no_grad()
def updated_expert_bias(bias: torch.Tensor, counts: torch.Tensor, *, rate: float,
                        center: bool = False) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update (§2.1.2): bias_i + rate * sign(mean - count_i), from the
    step's token counts (E,) summed over microbatches and data-parallel ranks (each token once).
    `center` subtracts the update's mean (torchtitan), which keeps the bias from drifting and
    changes no choice. A new tensor; the trainer copies it into every router's `expert_bias`."""
    counts = counts.to(torch.float64)  # integers: exact, so every rank computes the same bits
    delta = rate * torch.sign(counts.mean() - counts)
    if center:
        delta = delta - delta.mean()
    return (bias.to(torch.float64) + delta).to(bias.dtype)
