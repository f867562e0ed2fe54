"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, arXiv 2412.19437 §2.1.1)
and YaRN's RoPE (Peng et al. 2023, arXiv 2309.00071), as transformers' DeepseekV3Attention computes them
(our own code; tests/test_mla.py compares with transformers within 1e-5). Submodules are named as HF's, so
checkpoint keys map by name.

Per token x (C), with H heads, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v = v_head_dim:

  query    q_b_proj(q_a_layernorm(q_a_proj(x)))      C -> q_lora_rank -> H (d_n + d_r)   (low-rank; V3)
           or q_proj(x)                               C -> H (d_n + d_r)                  (q_lora_rank null)
  latent   kv_a_proj_with_mqa(x) = [c_kv, k_r]        C -> kv_lora_rank + d_r; c_kv through kv_a_layernorm
  keys     [k_n, RoPE(k_r)], k_n, v = kv_b_proj(c_kv) kv_lora_rank -> H (d_n + d_v); the rotary key k_r is
                                                      one head shared by every head (the "decoupled" key)
  scores   softmax([q_n, RoPE(q_r)] . k * scale)      scale = (d_n + d_r)^-1/2, times YaRN's
                                                      mscale(factor, mscale_all_dim)^2 where scaled
  out      o_proj(scores @ v)                         H d_v -> C

Under tensor parallel a rank keeps H/tp heads (q_b_proj or q_proj, kv_b_proj column-parallel, o_proj
row-parallel); the compressions q_a_proj, kv_a_proj_with_mqa and their norms stay whole on every rank
(torchtitan's and Megatron's split) and see only this rank's heads' gradient: the tp group sums it (the
layer's `partial`, models/deepseek.py). Under context parallel K (d_n + d_r per head) and V (d_v) of the
other positions come from the cp group (parallel/cp.py): their head dims differ.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.llama import RMSNorm, Rotary, apply_rope, rope_tables
from pipetrain.runtime.documents import Documents

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF and DeepSeek's code build them with the default


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, eq. 21: 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, yarn: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (dim / 2,) fp32 on CPU and the factor on cos and sin, as transformers'
    _compute_yarn_parameters: frequencies of more than beta_fast rotations over the original context kept,
    of fewer than beta_slow divided by `factor`, a linear ramp between (bounds floored and ceiled)."""
    factor, old_ctx = yarn["factor"], yarn["original_max_position_embeddings"]
    mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                        else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)  # CPU even inside torch.device("meta")
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low if high > low else 0.001)
            ).clamp(0, 1)  # 0: keep the frequency, 1: interpolate it
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def softmax_scale(qk_head_dim: int, yarn: Optional[dict[str, Any]]) -> float:
    """(d_n + d_r)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set (the
    non-rotary dimensions see the temperature too: DeepSeek's reference code, transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if yarn is not None and yarn.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return scale


class YarnRotary(Rotary):
    """Rotary's tables with YaRN's frequencies and its factor on cos and sin (fp32, then cast, as HF)."""

    def __init__(self, dim: int, theta: float, yarn: Optional[dict[str, Any]]) -> None:
        super().__init__(dim, theta, None)
        self.factor = 1.0
        if yarn is not None:
            self.inv_freq, self.factor = yarn_inv_freq(dim, theta, yarn)

    def tables(self, t: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (t, str(device), dtype)
        if key not in self._cache:
            freqs = torch.outer(torch.arange(t, dtype=torch.float32, device=device), self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, d_r): the half-split layout
            self._cache[key] = ((emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype))
        return self._cache[key]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) with RoPE pairs (x0, x1), (x2, x3), ... -> (..., d) as [x0, x2, ..., x1, x3, ...]: the
    half-split layout apply_rope rotates, giving transformers' apply_rotary_pos_emb_interleave exactly."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention, forward(x, docs) as models/llama.py's Attention (causal, or within the
    documents of `docs`; `context`: parallel/cp.py's ContextAttention, set by parallelize)."""

    def __init__(self, *, hidden: int, heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, attention_bias: bool,
                 rotary: Rotary, rope_interleave: bool, scale: float) -> None:
        super().__init__()
        self.heads, self.rotary, self.interleave, self.scale = heads, rotary, rope_interleave, scale
        self.nope, self.rope, self.v_dim, self.kv_rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.compressed_q = q_lora_rank is not None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=attention_bias)
        self.context: Optional[Any] = None  # context parallel (parallel/cp.py: ContextAttention), set by parallelize

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        b, t, _ = x.shape  # sequence parallel: x is whole here (the tp region gathered it)
        q_in = self.q_a_proj(x) if self.compressed_q else x  # (B, T, r_q), or (B, T, C) for q_proj
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)  # (B, T, r), (B, T, d_r)
        q, kv = self.up(q_in, latent)
        y = self.core(q, kv, k_rot, docs)  # (B, H, T, d_v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.v_dim))  # (B, T, H d_v) -> (B, T, C)

    def up(self, q_in: torch.Tensor, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The up-projections (selective recompute's "mla_up", Megatron's mla_up_proj): the query's
        (B, T, r_q) -> (B, T, H (d_n + d_r)) through its norm (or q_proj from x), the latent's (B, T, r_kv)
        -> (B, T, H (d_n + d_v)) through its norm. Recomputed, the block keeps the compressed inputs only."""
        q = self.q_b_proj(self.q_a_layernorm(q_in)) if self.compressed_q else self.q_proj(q_in)
        return q, self.kv_b_proj(self.kv_a_layernorm(latent))

    def up_weights(self) -> tuple[str, ...]:
        """The sub-modules whose weights `up` uses (selective recompute differentiates them in B)."""
        q = ("q_a_layernorm", "q_b_proj") if self.compressed_q else ("q_proj",)
        return (*q, "kv_a_layernorm", "kv_b_proj")

    def core(self, q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor, docs: Optional[Documents] = None
             ) -> torch.Tensor:
        """Core attention (selective recompute's "attention"): q (B, T, H (d_n + d_r)), kv (B, T, H (d_n + d_v))
        and the shared rotary key (B, T, d_r) -> RoPE, attention -> (B, H, T, d_v)."""
        b, t, _ = q.shape
        q = q.view(b, t, self.heads, self.nope + self.rope).transpose(1, 2)  # (B, H, T, d_n + d_r); tp: H/tp
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv = kv.view(b, t, self.heads, self.nope + self.v_dim).transpose(1, 2)  # (B, H, T, d_n + d_v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(b, 1, t, self.rope)  # (B, 1, T, d_r): one rotary key for every head
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cp = self.context  # under context parallel x holds this rank's positions of each sequence only
        cos, sin = rope_tables(self.rotary, cp, docs, t, q.device, q.dtype)
        q = torch.cat((q_nope, apply_rope(q_rot, cos, sin)), dim=-1)  # (B, H, T, d_n + d_r)
        k = torch.cat((k_nope, apply_rope(k_rot, cos, sin).expand(-1, self.heads, -1, -1)), dim=-1)
        if cp is not None:  # causal (or per document) by true position, K/V of the other positions from the cp group
            return cp.attend(q, k, v, docs, scale=self.scale)
        if docs is not None:  # block-causal: each query the keys of its own document up to itself
            return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask(), scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
