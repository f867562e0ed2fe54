"""The DeepSeek family's sizes and costs: multi-head latent attention's numbers for the decoder cost model
(decoder_costs.py), the published parameter count and each layer's LayerCost, pure arithmetic over the resolved
config (models/deepseek.py builds the layers)."""

from __future__ import annotations

from typing import Any

from pipetrain.models.decoder_costs import AttentionCost, decoder_layer_costs, decoder_param_count
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


def deepseek_param_count(cfg: dict[str, Any]) -> int:
    """Distinct parameters of the unsplit model (a tied embedding counted once), as published."""
    return decoder_param_count(cfg, mla_attention(cfg, seq=1).params)



def deepseek_layer_costs(cfg: dict[str, Any], *, microbatch: int, seq: int, tflops: float,
                         bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer costs of one microbatch (decoder_costs.decoder_layer_costs with MLA); MLA's blocks declare no
    selective-recompute modules yet (mla_up: a later change)."""
    return decoder_layer_costs(cfg, mla_attention(cfg, seq=seq), microbatch=microbatch, seq=seq, tflops=tflops,
                               bytes_per_value=bytes_per_value)
