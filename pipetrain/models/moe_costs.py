"""Sizes and per-token work of a Llama-family model's MLPs when some of them are MoE (pure arithmetic).

A dense SwiGLU MLP of width I stores and multiplies 3 C I weights per token. An MoE block stores
E experts of width I_e (3 C I_e each), the router (E C) and the shared MLP (3 C I_s, + C for its
gate), but multiplies each token by only K experts: its *active* parameters are K 3 C I_e + E C +
shared. FLOPs per token follow the active parameters (decoder_costs.layer_cost), so MFU and the
simulator count what a token actually computes; memory counts what is stored. The router's
`expert_bias` is state moved by the aux_free rule, not a weight: it counts in neither (published
totals, e.g. Mixtral-8x7B's 46.7B, have no such term).
"""

from __future__ import annotations

from typing import Any

from pipetrain.config.moe import MoEConfig


def moe_config(cfg: dict[str, Any]) -> MoEConfig | None:
    moe = cfg.get("moe")
    return None if moe is None else moe if isinstance(moe, MoEConfig) else MoEConfig(**moe)


def mlp_params(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(stored, active per token) parameters of each decoder block's MLP, block by block."""
    c, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dense = 3 * c * i
    m = moe_config(cfg)
    if m is None:
        return [(dense, dense)] * n
    width, shared_width = m.expert_width(i), m.shared_width(i)
    shared = 3 * c * shared_width + (c if m.shared_gate else 0)
    router = m.num_experts * c
    stored = m.num_experts * 3 * c * width + router + shared
    active = m.top_k * 3 * c * width + router + shared
    return [(stored, active) if m.is_moe(b) else (dense, dense) for b in range(n)]


def mlp_values(cfg: dict[str, Any]) -> list[int]:
    """Activation values each block's MLP keeps per token for backward: a dense MLP its gate,
    silu(gate), up and their product (4 I); an MoE block the router's fp32 logits and scores (2 E),
    per chosen expert the token copy, those 4 values of I_e and the weighted output (K (2 C + 4 I_e)),
    the (T K, C) combine buffer (K C) and the shared MLP's 4 I_s."""
    c, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    m = moe_config(cfg)
    if m is None:
        return [4 * i] * n
    width, shared_width = m.expert_width(i), m.shared_width(i)
    moe = 2 * m.num_experts + m.top_k * (3 * c + 4 * width) + 4 * shared_width
    return [moe if m.is_moe(b) else 4 * i for b in range(n)]


def idle_params(cfg: dict[str, Any]) -> int:
    """Parameters a token does not touch: the experts it is not routed to, summed over the blocks
    (a model's active parameters are its total less these)."""
    return sum(stored - active for stored, active in mlp_params(cfg))


def experts_and_a2a(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """Per decoder block, (its routed experts' parameters, the values per token its all-to-alls carry in one
    pass): an MoE block's E x 3 C I_e and 2 K C (dispatch sends each token's K copies of its C values,
    combine brings them back; the router and shared experts stay on the rank); a dense block's (0, 0)."""
    c, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    m = moe_config(cfg)
    if m is None:
        return [(0, 0)] * n
    experts = m.num_experts * 3 * c * m.expert_width(cfg["intermediate_size"])
    return [(experts, 2 * m.top_k * c) if m.is_moe(b) else (0, 0) for b in range(n)]


def experts_active(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """Per decoder block, (the routed experts' parameters that multiply each token, K x 3 C I_e: what the
    experts node of node execution computes, models/moe_nodes.py; the shared experts' that do, 3 C I_s plus
    C for a shared gate: what its post node computes beside the gates and the residual); a dense block's (0, 0)."""
    m = moe_config(cfg)
    if m is None:
        return [(0, 0)] * cfg["num_hidden_layers"]
    c, i = cfg["hidden_size"], cfg["intermediate_size"]
    routed = m.top_k * 3 * c * m.expert_width(i)
    shared = 3 * c * m.shared_width(i) + (c if m.shared_gate else 0)  # 0 without (a gate needs a shared expert)
    return [(routed, shared) if m.is_moe(b) else (0, 0) for b in range(cfg["num_hidden_layers"])]
