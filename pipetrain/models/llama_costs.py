"""The Llama family's sizes and costs: grouped-query attention's numbers for the decoder cost model
(decoder_costs.py), parameters per pipeline layer, and each layer's LayerCost (FLOPs, activation bytes,
selective recompute's modules), pure arithmetic over the resolved config (models/llama.py builds the layers)."""

from __future__ import annotations

from typing import Any

from pipetrain.models.decoder_costs import (AttentionCost, RecomputeModule, decoder_layer_costs,
                                            decoder_layer_params, decoder_param_count, gqa_block_shape,
                                            recompute_costs)
from pipetrain.partition.costs import LayerCost


# ---- sizes and costs (pure arithmetic over the resolved config) ------------------------------


def llama_attention(cfg: dict[str, Any], *, seq: int) -> AttentionCost:
    """Grouped-query attention's numbers (decoder_costs.AttentionCost): q, k, v and o (+ biases, QK-norm)
    parameters; SDPA keeps q, k, v and its output (2 H hd + 2 KV hd; o_proj's input is a view of that output),
    QK-norm adds its inputs and normalized values (2 H hd + 2 KV hd); 2 * 2 * T * (H * hd) FLOPs per token."""
    c = cfg["hidden_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    qkv_bias = cfg["attention_bias"] or cfg["qkv_bias"]
    attn = c * (q + 2 * kv) + q * c + qkv_bias * (q + 2 * kv) + cfg["attention_bias"] * c
    qk_norm = (2 * cfg["head_dim"] if cfg.get("qk_norm_per_head", True) else q + kv) if cfg["qk_norm"] else 0
    return AttentionCost(params=attn + qk_norm, values=2 * q + 2 * kv + cfg["qk_norm"] * 2 * (q + kv),
                         flops=2 * 2 * seq * q, kv_values=2 * kv,
                         block_shape=None if cfg.get("moe") else gqa_block_shape(cfg))  # MoE: timed by its FLOPs


def gqa_recompute(cfg: dict[str, Any], *, seq: int, bytes_per_value: int) -> tuple[RecomputeModule, ...]:
    """Grouped-query attention's selective-recompute modules per token (decoder_costs.recompute_costs): its
    QK-norms their normalized values (H hd + KV hd; norm), core attention its fp32 log-sum-exp (H: flash
    attention keeps q, k, v and its output either way; RoPE's q and k replace the projections' of equal size).
    FLOPs: a norm 4 values, attention 4 T H hd and RoPE (6 a value)."""
    heads = cfg["num_attention_heads"]
    q, kv = heads * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    qk = q + kv if cfg["qk_norm"] else 0
    return (("norm", qk * bytes_per_value, 4.0 * qk), ("attention", 4 * heads, 4.0 * seq * q + 6 * (q + kv)))


def llama_layer_params(cfg: dict[str, Any]) -> list[int]:
    """Parameters each pipeline layer stores (decoder_costs.decoder_layer_params)."""
    return decoder_layer_params(cfg, llama_attention(cfg, seq=1).params)


def llama_param_count(cfg: dict[str, Any]) -> int:
    """Distinct parameters of the unsplit model (a tied embedding counted once), as published."""
    return decoder_param_count(cfg, llama_attention(cfg, seq=1).params)


def llama_layer_costs(cfg: dict[str, Any], *, microbatch: int, seq: int, tflops: float,
                      bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer costs of one microbatch (decoder_costs.decoder_layer_costs with grouped-query attention)."""
    costs = decoder_layer_costs(cfg, llama_attention(cfg, seq=seq), microbatch=microbatch, seq=seq, tflops=tflops,
                                bytes_per_value=bytes_per_value)
    return recompute_costs(cfg, costs, gqa_recompute(cfg, seq=seq, bytes_per_value=bytes_per_value),
                           bytes_per_value=bytes_per_value)
