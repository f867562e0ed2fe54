"""The Llama family's sizes and costs: parameters per pipeline layer, and each layer's LayerCost (FLOPs,
activation bytes, selective recompute's modules), pure arithmetic over the resolved config (models/llama.py
builds the layers)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipetrain.models.causal_lm import layer_cost
from pipetrain.models.moe_costs import experts_active, experts_and_a2a, mlp_params, mlp_values, moe_config
from pipetrain.partition.costs import LayerCost


# ---- sizes and costs (pure arithmetic over the resolved config) ------------------------------


def llama_layer_params(cfg: dict[str, Any]) -> list[int]:
    """Parameters each pipeline layer stores. A tied head counts its copy of the embedding
    (V*C), what it stores when it sits on another stage: sum(...) = total + V*C then. MoE
    blocks count all their experts (moe_costs.mlp_params)."""
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    qkv_bias = cfg["attention_bias"] or cfg["qkv_bias"]
    attn = c * (q + 2 * kv) + q * c + qkv_bias * (q + 2 * kv) + cfg["attention_bias"] * c
    qk_norm = (2 * cfg["head_dim"] if cfg.get("qk_norm_per_head", True) else q + kv) if cfg["qk_norm"] else 0
    block = attn + 2 * c + qk_norm
    return [v * c, *(block + stored for stored, _ in mlp_params(cfg)), c + v * c]


def llama_param_count(cfg: dict[str, Any]) -> int:
    """Distinct parameters of the unsplit model (a tied embedding counted once), as published."""
    tied = cfg["vocab_size"] * cfg["hidden_size"] if cfg["tie_word_embeddings"] else 0
    return sum(llama_layer_params(cfg)) - tied


def llama_layer_costs(cfg: dict[str, Any], *, microbatch: int, seq: int, tflops: float,
                      bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer costs of one microbatch (causal_lm.layer_cost's FLOP model, as GPT-2's).

    Attention's matmuls are 2 * 2 * T * (H * hd) FLOPs per token. Activation values kept per
    token by a block (what autograd saves; tests/test_llama.py measures it): each RMSNorm
    keeps its input and normalized value and hands a new tensor to the projections (3C, twice),
    SDPA keeps q, k, v and its output (2 H hd + 2 KV hd; o_proj's input is a view of that
    output), the MLP gate, silu(gate), up and their product (4I); QK-norm adds its inputs and
    normalized values (2 H hd + 2 KV hd). Left out: one value per token per norm and per head
    (rsqrt, log-sum-exp) and the (T, hd) RoPE tables. The embedding keeps the int64 ids; the
    head its norm (3C), the log-softmax of the logits (V) and the int64 targets.
    """
    c, v, t, tokens = cfg["hidden_size"], cfg["vocab_size"], seq, microbatch * seq
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    params = llama_layer_params(cfg)
    # an MoE block multiplies each token by its active parameters only (moe_costs.py)
    matmuls = [params[1 + b] - stored + active for b, (stored, active) in enumerate(mlp_params(cfg))]
    block_values = [6 * c + 2 * q + 2 * kv + mlp + cfg["qk_norm"] * 2 * (q + kv) for mlp in mlp_values(cfg)]

    def cost(name: str, stored: int, matmul: int, attn_f: int, act: int) -> LayerCost:
        return layer_cost(name, stored=stored, matmul=matmul, attn_f=attn_f, act=act, tokens=tokens, tflops=tflops)

    out = [cost("embed", params[0], 0, 0, 8)]
    moe = experts_and_a2a(cfg)  # what expert parallel splits and sends; cp gathers each block's K and V
    blocks = [cost(f"layers.{i}", params[1 + i], matmuls[i], 2 * 2 * t * q, block_values[i] * bytes_per_value)
              for i in range(cfg["num_hidden_layers"])]
    # 2 forward FLOPs per routed (shared) expert parameter a token meets, of the block's forward FLOPs
    share = lambda active, b: 2 * active / b.flops_per_token if b.flops_per_token else 0.0  # noqa: E731
    out += [dataclasses.replace(b, experts_params=moe[i][0], a2a_values_per_token=moe[i][1],
                                kv_values_per_token=2 * kv, experts_flops_share=share(routed, b),
                                shared_experts_flops_share=share(shared, b))
            for i, (b, (routed, shared)) in enumerate(zip(blocks, experts_active(cfg)))]
    out.append(cost("head", params[-1], params[-1], 0, (3 * c + v) * bytes_per_value + 8))
    return recompute_costs(cfg, out, seq=t, bytes_per_value=bytes_per_value)


def recompute_costs(cfg: dict[str, Any], costs: list[LayerCost], *, seq: int, bytes_per_value: int) -> list[LayerCost]:
    """Each layer's selective-recompute modules (LayerCost.recompute_modules; parallel/recompute.py keeps a
    recomputed call's inputs, its output stays with the matmul reading it). Per token: a norm saves its
    normalized value (C; a per-head QK-norm H hd + KV hd), core attention its fp32 log-sum-exp (H: flash
    attention keeps q, k, v and its output either way), an MLP activation silu(gate) (I), the experts' theirs
    per chosen expert (K I_e). FLOPs: the norms 4 values, attention 4 T H hd + RoPE, an activation 5 values."""
    c, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    q, kv = heads * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    m, qk = moe_config(cfg), (q + kv if cfg["qk_norm"] else 0)
    blocks = []
    for b, layer in enumerate(costs[1:-1]):
        mods = [("norm", (2 * c + qk) * bytes_per_value, 4.0 * (2 * c + qk)),
                ("attention", 4 * heads, 4.0 * seq * q + 6 * (q + kv))]
        if m is not None and m.is_moe(b):
            width, shared = m.expert_width(i), m.shared_width(i)
            mods.append(("moe_act", m.top_k * width * bytes_per_value, 5.0 * m.top_k * width))
            if shared:
                mods.append(("mlp_act", shared * bytes_per_value, 5.0 * shared))
        else:
            mods.append(("mlp_act", i * bytes_per_value, 5.0 * i))
        blocks.append(dataclasses.replace(layer, recompute_modules=tuple(mods)))
    head = dataclasses.replace(costs[-1], recompute_modules=(("norm", c * bytes_per_value, 4.0 * c),))
    return [costs[0], *blocks, head]
