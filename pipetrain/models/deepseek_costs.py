"""The DeepSeek family's sizes and costs: multi-head latent attention's numbers for the decoder cost model
(decoder_costs.py), the published parameter count and each layer's LayerCost, pure arithmetic over the resolved
config (models/deepseek.py builds the layers)."""

from __future__ import annotations

from typing import Any

from pipetrain.models.decoder_costs import (AttentionCost, RecomputeModule, decoder_layer_costs, decoder_param_count,
                                            recompute_costs)
from pipetrain.partition.costs import LayerCost


def mla_attention(cfg: dict[str, Any], *, seq: int) -> AttentionCost:
    """MLA's numbers (decoder_costs.AttentionCost), H heads, d_qk = d_n + d_r, r_q / r_kv the ranks:

    params      C r_q + r_q + r_q H d_qk (or C H d_qk) + C (r_kv + d_r) + r_kv + r_kv H (d_n + d_v) + H d_v C
                (+ biases on q_a, kv_a and o);
    values      what autograd keeps per token: q_a's output, its norm's normalized value and output (3 r_q),
                the latent's (3 r_kv, its input a view of kv_a's output), the rotary key (d_r), and SDPA's q,
                k (H d_qk each), v and output (H d_v each; o_proj's input is a view of the output);
    flops       QK^T 2 T H d_qk and AV 2 T H d_v per token;
    kv_values   K and V of every head, H (d_qk + d_v): what context parallel gathers (not the latent).
    """
    c, h, r_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    r_q, d_r, d_v = cfg["q_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    d_qk = cfg["qk_nope_head_dim"] + d_r
    q = c * h * d_qk if r_q is None else c * r_q + r_q + r_q * h * d_qk
    kv = c * (r_kv + d_r) + r_kv + r_kv * h * (cfg["qk_nope_head_dim"] + d_v)
    bias = cfg["attention_bias"] * ((r_q or 0) + r_kv + d_r + c)
    values = 3 * (r_q or 0) + 3 * r_kv + d_r + 2 * h * d_qk + 2 * h * d_v
    return AttentionCost(params=q + kv + h * d_v * c + bias, values=values, flops=2 * seq * h * (d_qk + d_v),
                         kv_values=h * (d_qk + d_v))


def mla_recompute(cfg: dict[str, Any], *, seq: int, bytes_per_value: int) -> tuple[RecomputeModule, ...]:
    """MLA's selective-recompute modules per token (decoder_costs.recompute_costs; models/mla.py `core`, `up`):

    attention   SDPA's keys (H d_qk: the latent's up-projection and the rotary key, which the call keeps, make
                them) and its fp32 log-sum-exp (H); its queries become the query's up-projection (H d_qk) the
                call keeps; its values are a view of the latent's up-projection either way. FLOPs: QK^T and AV,
                RoPE on H + 1 rotary heads (6 a value);
    mla_up      the latent norms' normalized values and outputs (2 r_q + 2 r_kv; the projections' outputs
                stay with attention). FLOPs: both up-projections' GEMMs and the two norms (4 a value).
    """
    h, r_q, r_kv = cfg["num_attention_heads"], cfg["q_lora_rank"] or 0, cfg["kv_lora_rank"]
    d_r, d_qk = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q_up = (r_q or cfg["hidden_size"]) * h * d_qk  # q_b_proj, or q_proj from x without a low-rank query
    kv_up = r_kv * h * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    attention = mla_attention(cfg, seq=seq).flops + 6.0 * (h + 1) * d_r
    return (("attention", h * d_qk * bytes_per_value + 4 * h, attention),
            ("mla_up", 2 * (r_q + r_kv) * bytes_per_value, 2.0 * (q_up + kv_up) + 4.0 * (r_q + r_kv)))


def deepseek_param_count(cfg: dict[str, Any]) -> int:
    """Distinct parameters of the unsplit model (a tied embedding counted once), as published."""
    return decoder_param_count(cfg, mla_attention(cfg, seq=1).params)


def deepseek_layer_costs(cfg: dict[str, Any], *, microbatch: int, seq: int, tflops: float,
                         bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer costs of one microbatch (decoder_costs.decoder_layer_costs with MLA), selective recompute's
    modules with MLA's (mla_recompute)."""
    costs = decoder_layer_costs(cfg, mla_attention(cfg, seq=seq), microbatch=microbatch, seq=seq, tflops=tflops,
                                bytes_per_value=bytes_per_value)
    return recompute_costs(cfg, costs, mla_recompute(cfg, seq=seq, bytes_per_value=bytes_per_value),
                           bytes_per_value=bytes_per_value)
