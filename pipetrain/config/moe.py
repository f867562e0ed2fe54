"""Schema of a Mixture-of-Experts layer: routing, balancing, shared experts (pure: no torch).

The layer (pipetrain/models/moe.py) replaces a block's dense MLP by `num_experts` SwiGLU experts,
of which a router picks `top_k` per token:

  scores     softmax over the experts' logits (Mixtral, Qwen2/3-MoE, OLMoE) or a sigmoid per
             expert (DeepSeek-V3, arXiv 2412.19437 eq. 15);
  choice     top-k of the scores plus a per-expert bias (the bias steers the choice only: the
             gates come from the unbiased scores); with n_group > 1, DeepSeek's group-limited
             routing first keeps the topk_group groups whose two best experts score highest
             (group_score=top2, DeepSeek-V3), or whose best expert does (max: DeepSeek-V2);
  gates      the chosen scores, renormalised to sum to 1 (norm_topk_prob) and multiplied by
             routed_scaling_factor (DeepSeek-V3: 2.5).

`balance` says how experts are kept evenly loaded:
  aux_free      DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step the bias
                of an overloaded expert falls, of an underloaded one rises, by bias_update_rate;
  aux_loss      Switch / GShard's auxiliary loss E * sum_i f_i P_i over the batch, times aux_loss_coef;
  seq_aux_loss  the same loss per sequence, averaged (DeepSeek-V3 eq. 17-20);
  none          neither (a fixed bias, e.g. one loaded from a checkpoint, still steers the choice).

Dropless by default; capacity_factor c caps every expert at ceil(c * tokens * top_k / num_experts)
assignments per forward, keeping the highest gates (Megatron's drop policy `probs`).

Which blocks of a model are MoE (`is_moe`): all but the first `first_dense_layers` (DeepSeek-V3's
first_k_dense_replace), those listed in `dense_layers` (Qwen's mlp_only_layers) and those whose
index i (from 0) misses (i + 1) % layer_freq == 0 (Qwen's decoder_sparse_step); the others keep
the model's dense SwiGLU MLP of model.intermediate_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

SCORE_FUNCS = ("softmax", "sigmoid")
BALANCES = ("aux_free", "aux_loss", "seq_aux_loss", "none")
EXPERTS_IMPLS = ("loop", "grouped")
GROUP_SCORES = ("top2", "max")  # a group's score: its two best experts' sum (DeepSeek-V3), its best (V2)


@dataclass
class MoEConfig:
    num_experts: int = 8  # routed experts (Mixtral-8x7B: 8)
    top_k: int = 2  # experts per token (Mixtral: 2)
    score_func: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True  # renormalise the chosen scores to sum to 1 (Mixtral always; Qwen2-MoE: false)
    routed_scaling_factor: float = 1.0  # gates times this (DeepSeek-V3: 2.5)
    n_group: int = 1  # expert groups for group-limited routing (DeepSeek-V3: 8); 1: no limit
    topk_group: int = 1  # groups a token may use (DeepSeek-V3: 4)
    group_score: str = "top2"  # top2 | max: how a group scores (DeepSeek-V2's group_limited_greedy: max)
    balance: str = "aux_free"  # aux_free | aux_loss | seq_aux_loss | none
    aux_loss_coef: float = 1e-3  # weight of the aux_loss / seq_aux_loss term (DeepSeek-V3's seq: 1e-4)
    # aux_free step of the bias per optimizer step (DeepSeek-V3's gamma). moe-tiny balances best at 1e-3
    # too: 1e-2 and 5e-2 overshoot (bench/moe_balance.py); what helps there is a lower optim.lr
    bias_update_rate: float = 1e-3
    num_shared_experts: int = 0  # experts every token goes through (DeepSeek-V3: 1; Qwen2-MoE: 1, 4x wide)
    shared_gate: bool = False  # scale the shared experts by sigmoid(linear(x)) (Qwen2-MoE)
    capacity_factor: Optional[float] = None  # None: dropless; c: each expert takes <= ceil(c T K / E)
    force_balanced: bool = False  # benchmarks only: route round-robin, ignoring the scores' choice
    experts_impl: str = "loop"  # loop (the reference) | grouped (torch grouped_mm; see models/moe.py)
    intermediate_size: Optional[int] = None  # one routed expert's width (HF moe_intermediate_size); null: the model's
    shared_intermediate_size: Optional[int] = None  # shared MLP's width (Qwen2-MoE); null: num_shared_experts x expert
    first_dense_layers: int = 0  # the first k blocks keep a dense MLP (DeepSeek-V3's first_k_dense_replace: 3)
    layer_freq: int = 1  # block i is MoE when (i + 1) % layer_freq == 0 (Qwen's decoder_sparse_step)
    dense_layers: list[int] = field(default_factory=list)  # blocks kept dense, by index (Qwen's mlp_only_layers)

    def __post_init__(self) -> None:
        for knob in ("num_experts", "top_k", "n_group", "topk_group", "layer_freq"):
            if getattr(self, knob) < 1:
                raise ValueError(f"model.moe.{knob} must be >= 1 (got {getattr(self, knob)})")
        for knob, value, choices in (("score_func", self.score_func, SCORE_FUNCS),
                                     ("balance", self.balance, BALANCES),
                                     ("experts_impl", self.experts_impl, EXPERTS_IMPLS),
                                     ("group_score", self.group_score, GROUP_SCORES)):
            if value not in choices:
                raise ValueError(f"model.moe.{knob}={value!r} is unknown: choose one of {', '.join(choices)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}: "
                             "lower top_k")
        self._check_groups()
        for knob in ("aux_loss_coef", "bias_update_rate", "routed_scaling_factor", "capacity_factor"):
            value = getattr(self, knob)
            if value is not None and not math.isfinite(value):  # nan passes every comparison below
                raise ValueError(f"model.moe.{knob} must be a finite number (got {value})")
        for knob in ("aux_loss_coef", "bias_update_rate", "num_shared_experts", "first_dense_layers"):
            if getattr(self, knob) < 0:
                raise ValueError(f"model.moe.{knob} must be >= 0 (got {getattr(self, knob)})")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"model.moe.routed_scaling_factor must be > 0 (got {self.routed_scaling_factor})")
        if self.shared_gate and self.num_shared_experts == 0:
            raise ValueError("model.moe.shared_gate=true gates the shared experts: "
                             "set model.moe.num_shared_experts >= 1 or drop it")
        for knob in ("intermediate_size", "shared_intermediate_size"):
            if getattr(self, knob) is not None and getattr(self, knob) < 1:
                raise ValueError(f"model.moe.{knob} must be >= 1, or null for the default (got {getattr(self, knob)})")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"model.moe.capacity_factor must be > 0, or null for dropless "
                             f"(got {self.capacity_factor})")

    def _check_groups(self) -> None:
        if self.n_group == 1:
            if self.topk_group != 1:
                raise ValueError(f"model.moe.topk_group={self.topk_group} needs group-limited routing: "
                                 "set model.moe.n_group > 1 or topk_group=1")
            return
        if self.num_experts % self.n_group:
            raise ValueError(f"model.moe.n_group={self.n_group} does not divide model.moe.num_experts="
                             f"{self.num_experts}: choose a divisor")
        per_group = self.num_experts // self.n_group
        if per_group < 2 and self.group_score == "top2":  # a group scores as the sum of its two best experts
            raise ValueError(f"model.moe.n_group={self.n_group} leaves {per_group} expert per group; group "
                             f"scores sum each group's top 2: use n_group <= {self.num_experts // 2}")
        if self.topk_group > self.n_group:
            raise ValueError(f"model.moe.topk_group={self.topk_group} exceeds model.moe.n_group={self.n_group}: "
                             "lower topk_group")
        if self.top_k > self.topk_group * per_group:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds the {self.topk_group * per_group} experts "
                             f"of topk_group={self.topk_group} groups: raise topk_group or lower top_k")

    def check_blocks(self, blocks: int, *, knob: str) -> None:
        """The knobs that name decoder blocks, against a model of `blocks` of them (`knob` names its size)."""
        outside = sorted({b for b in self.dense_layers if not 0 <= b < blocks})
        if outside:
            raise ValueError(f"model.moe.dense_layers names block {', '.join(map(str, outside))} of a model with "
                             f"{blocks} blocks (0-{blocks - 1}, {knob}={blocks}): list blocks below {blocks}")
        if self.first_dense_layers > blocks:
            raise ValueError(f"model.moe.first_dense_layers={self.first_dense_layers} exceeds the model's {blocks} "
                             f"blocks ({knob}={blocks}): lower it")

    def is_moe(self, block: int) -> bool:
        """Whether decoder block `block` (0-based) has an MoE layer rather than the dense MLP."""
        return (block >= self.first_dense_layers and block not in self.dense_layers
                and (block + 1) % self.layer_freq == 0)

    def expert_width(self, model_intermediate: int) -> int:
        return self.intermediate_size or model_intermediate

    def shared_width(self, model_intermediate: int) -> int:
        """The shared experts' MLP width (0: none)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_intermediate_size or self.num_shared_experts * self.expert_width(model_intermediate)


# Knobs a training run chooses, not the checkpoint: a model.pretrained folder's config.json leaves them as set.
TRAINING_KNOBS = ("balance", "aux_loss_coef", "bias_update_rate", "capacity_factor", "force_balanced", "experts_impl")
HF_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # config.json model_type values with MoE layers


def moe_from_hf(hf: dict[str, Any]) -> Optional[MoEConfig]:
    """The MoE knobs of an HF config.json (None for a dense model_type). Mixtral and OLMoE: every
    block MoE, experts of intermediate_size (top-k renormalised: Mixtral always, OLMoE if
    norm_topk_prob); Qwen2/3-MoE: moe_intermediate_size experts, decoder_sparse_step,
    mlp_only_layers, norm_topk_prob, and Qwen2-MoE's gated shared expert. balance=none: the run's
    preset or command line chooses it (keep_training_knobs)."""
    kind = hf.get("model_type")
    if kind not in HF_MOE_TYPES:
        return None
    key = "num_local_experts" if kind == "mixtral" else "num_experts"  # how each family's config.json names it
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        raise KeyError(key)
    if hf.get("num_experts_per_tok", 0) > experts:  # the folder's numbers, not this run's model.moe.top_k
        raise ValueError(f"config.json num_experts_per_tok={hf['num_experts_per_tok']} exceeds its {key}={experts}: "
                         f"the folder's config.json is inconsistent; fix it there")
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(f"config.json router_jitter_noise={hf['router_jitter_noise']} is not supported "
                         f"(pipetrain routes without noise): set it to 0.0")
    out = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"], score_func="softmax", balance="none")
    if hf.get("clip_qkv") is not None:  # OLMoE's optional clamp of q, k, v
        raise ValueError(f"config.json clip_qkv={hf['clip_qkv']} is not supported (pipetrain does not clamp q, k, "
                         f"v): set it to null")
    if kind == "mixtral":
        return out
    out.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
    if kind == "olmoe":  # experts of intermediate_size, every block MoE
        return out
    out.intermediate_size = hf["moe_intermediate_size"]
    out.layer_freq = hf.get("decoder_sparse_step", 1)
    out.dense_layers = list(hf.get("mlp_only_layers") or [])
    if kind == "qwen2_moe" and hf.get("shared_expert_intermediate_size", 0):
        out.num_shared_experts, out.shared_gate = 1, True
        out.shared_intermediate_size = hf["shared_expert_intermediate_size"]
    out.__post_init__()
    return out


def keep_training_knobs(theirs: Optional[MoEConfig], mine: Optional[MoEConfig]) -> Optional[MoEConfig]:
    """A pretrained folder's MoE shape with this run's training knobs (TRAINING_KNOBS), whatever the
    folder's config.json says of them."""
    if theirs is None or mine is None:
        return theirs
    for knob in TRAINING_KNOBS:
        setattr(theirs, knob, getattr(mine, knob))
    theirs.__post_init__()
    return theirs
