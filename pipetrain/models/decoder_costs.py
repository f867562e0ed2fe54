"""Sizes and per-layer costs of a pre-norm decoder language model whatever its attention (pure arithmetic over
a resolved config dict): the Llama family's grouped-query attention (models/llama.py) and DeepSeek's
multi-head latent attention (models/deepseek.py) each give their attention's numbers; the embedding, the two
RMSNorms, the dense or MoE MLP (moe_costs.py) and the head are counted here once for both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from pipetrain.models.moe_costs import experts_active, experts_and_a2a, mlp_params, mlp_values, moe_config
from pipetrain.partition.costs import COLUMN, ROW, LayerCost, LayerShape, ms_from_flops


@dataclass(frozen=True)
class AttentionCost:
    """One block's attention, per token: `params` stored (all multiply each token), `values` activations
    autograd keeps for backward, `flops` forward FLOPs of the weightless matmuls (QK^T, AV) at the
    sequence's length, `kv_values` the K and V values context parallel gathers; `block_shape` the whole
    block's GEMMs for a device's timing where they are known (planner/compute.py; None: timed by its FLOPs)."""

    params: int
    values: int
    flops: int
    kv_values: int
    block_shape: Optional[LayerShape] = None


def layer_cost(name: str, *, stored: int, matmul: int, attn_f: int, act: int, tokens: int,
               tflops: float, shape: LayerShape | None = None) -> LayerCost:
    """One layer's LayerCost from per-token counts (the nanoGPT / PaLM appendix B estimate):
    `matmul` parameters that multiply each token (forward 2 FLOPs each; backward: B and W
    2 each) and `attn_f` forward FLOPs of attention's weightless matmuls (QK^T, AV), whose
    backward (2x) is all input-gradient (B). `stored` parameters, `act` bytes kept per token."""
    f, b, w = 2 * matmul + attn_f, 2 * matmul + 2 * attn_f, 2 * matmul
    return LayerCost(name, ms_from_flops(f * tokens, tflops), ms_from_flops(b * tokens, tflops),
                     ms_from_flops(w * tokens, tflops), params=stored, flops_per_token=float(f),
                     activation_bytes_per_token=act, shape=shape)


def mtp_stored_params(cfg: dict[str, Any], block: int) -> tuple[int, int]:
    """(parameters the head layer stores for its MTP depths, of them copies of weights stored elsewhere):
    per depth enorm, hnorm, shared_head.norm (3C), eh_proj (2C x C) and a block like the model's last (`block`
    parameters); the embedding beside an untied lm_head is a copy of layer 0's (tied, the lm_head is it)."""
    depth = (cfg.get("mtp") or {}).get("depth", 0)
    if not depth:
        return 0, 0
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    copy = 0 if cfg["tie_word_embeddings"] else v * c
    return depth * (3 * c + 2 * c * c + block) + copy, copy


def with_mtp(head: LayerCost, block: LayerCost, cfg: dict[str, Any], *, tokens: int, tflops: float,
             bytes_per_value: int) -> LayerCost:
    """The head layer's LayerCost with its MTP depths as work of that layer (so of the last stage's rank): per
    depth a block like the model's last, eh_proj (2C x C), the shared head's lm_head (V x C) and what they keep
    per token (the two input norms, the concatenation and eh_proj's output: 3C + 3C + 2C + C; the shared head's
    norm and log-softmax: 3C + V); positions counted as T (depth k has T - k: an overestimate of k / T)."""
    depth = (cfg.get("mtp") or {}).get("depth", 0)
    if not depth:
        return head
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    stored, _ = mtp_stored_params(cfg, block.params)
    extra = layer_cost("mtp", stored=0, matmul=2 * c * c + v * c, attn_f=0,
                       act=(12 * c + v) * bytes_per_value, tokens=tokens, tflops=tflops)
    parts = [head, *[block, extra] * depth]
    flops = sum(p.flops_per_token for p in parts)

    def share(key: str) -> float:  # a share of the layer's forward FLOPs, weighted by each part's
        return sum(getattr(p, key) * p.flops_per_token for p in parts) / flops if flops else 0.0

    return LayerCost(f"head+mtp{depth}", *(sum(getattr(p, k) for p in parts) for k in ("f_ms", "b_ms", "w_ms")),
                     params=head.params + stored, flops_per_token=flops,
                     activation_bytes_per_token=sum(p.activation_bytes_per_token for p in parts),
                     experts_params=depth * block.experts_params,
                     a2a_values_per_token=depth * block.a2a_values_per_token,
                     kv_values_per_token=depth * block.kv_values_per_token,
                     experts_flops_share=share("experts_flops_share"),
                     shared_experts_flops_share=share("shared_experts_flops_share"))


def decoder_layer_params(cfg: dict[str, Any], attention: int) -> list[int]:
    """Parameters each pipeline layer stores, blocks of `attention` parameters each. A tied head counts its
    copy of the embedding (V*C), what it stores when it sits on another stage: sum(...) = total + V*C then.
    MoE blocks count all their experts (moe_costs.mlp_params); the head its MTP depths (mtp_stored_params)."""
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    blocks = [attention + 2 * c + stored for stored, _ in mlp_params(cfg)]
    return [v * c, *blocks, c + v * c + mtp_stored_params(cfg, blocks[-1])[0]]


def decoder_param_count(cfg: dict[str, Any], attention: int) -> int:
    """Distinct parameters of the unsplit model (a tied embedding counted once), as published (with MTP: the
    main model's and the MTP module's, its copies of the embedding and lm_head counted once)."""
    tied = cfg["vocab_size"] * cfg["hidden_size"] if cfg["tie_word_embeddings"] else 0
    params = decoder_layer_params(cfg, attention)
    return sum(params) - tied - mtp_stored_params(cfg, params[-2])[1]


def decoder_layer_costs(cfg: dict[str, Any], attention: AttentionCost, *, microbatch: int, seq: int, tflops: float,
                        bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer costs of one microbatch (layer_cost's FLOP model, as GPT-2's).

    Activation values kept per token by a block (what autograd saves; tests/test_llama.py and
    tests/test_deepseek.py measure it): each RMSNorm keeps its input and normalized value and hands a new
    tensor to the projections (3C, twice), the attention its `values`, the MLP gate, silu(gate), up and their
    product (4I; an MoE block moe_costs.mlp_values). Left out: one value per token per norm and per head
    (rsqrt, log-sum-exp) and the (T, hd) RoPE tables. The embedding keeps the int64 ids; the head its norm
    (3C), the log-softmax of the logits (V) and the int64 targets; with MTP the head layer is `head+mtp<D>`,
    its depths' work counted on it (with_mtp). The embedding, the head and the blocks whose attention
    knows their GEMMs (AttentionCost.block_shape) carry shapes for a device's timing.
    """
    c, v, tokens = cfg["hidden_size"], cfg["vocab_size"], microbatch * seq
    params = decoder_layer_params(cfg, attention.params)
    # an MoE block multiplies each token by its active parameters only (moe_costs.py)
    matmuls = [params[1 + b] - stored + active for b, (stored, active) in enumerate(mlp_params(cfg))]
    block_values = [6 * c + attention.values + mlp for mlp in mlp_values(cfg)]

    def cost(name: str, stored: int, matmul: int, attn_f: int, act: int, shape: Optional[LayerShape] = None
             ) -> LayerCost:
        return layer_cost(name, stored=stored, matmul=matmul, attn_f=attn_f, act=act, tokens=tokens, tflops=tflops,
                          shape=shape)

    out = [cost("embed", params[0], 0, 0, 8, LayerShape(elementwise_whole=2 * c))]
    moe = experts_and_a2a(cfg)  # what expert parallel splits and sends; cp gathers each block's K and V
    blocks = [cost(f"layers.{i}", params[1 + i], matmuls[i], attention.flops, block_values[i] * bytes_per_value,
                   attention.block_shape) for i in range(cfg["num_hidden_layers"])]
    # 2 forward FLOPs per routed (shared) expert parameter a token meets, of the block's forward FLOPs
    share = lambda active, b: 2 * active / b.flops_per_token if b.flops_per_token else 0.0  # noqa: E731
    out += [dataclasses.replace(b, experts_params=moe[i][0], a2a_values_per_token=moe[i][1],
                                kv_values_per_token=attention.kv_values, experts_flops_share=share(routed, b),
                                shared_experts_flops_share=share(shared, b))
            for i, (b, (routed, shared)) in enumerate(zip(blocks, experts_active(cfg)))]
    head = cost("head", c + v * c, c + v * c, 0, (3 * c + v) * bytes_per_value + 8,
                LayerShape(((c, v, COLUMN),), elementwise_values=4 * v, elementwise_whole=2 * c))
    out.append(with_mtp(head, out[-1], cfg, tokens=tokens, tflops=tflops, bytes_per_value=bytes_per_value))
    return out


def gqa_block_shape(cfg: dict[str, Any]) -> LayerShape:
    """A dense grouped-query-attention block's GEMMs (q, k and v; o; gate and up; down) and element-wise values
    for a device's timing: RoPE on q and k and SwiGLU (2I in, I out) split by tp, the two RMSNorms (2C each) and
    residual adds (3C each) whole."""
    c, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return LayerShape(((c, q + 2 * kv, COLUMN), (q, c, ROW), (c, 2 * i, COLUMN), (i, c, ROW)),
                      cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                      elementwise_values=3 * i + 2 * (q + kv), elementwise_whole=10 * c)


RecomputeModule = tuple[str, int, float]  # LayerCost.recompute_modules' entry: (name, bytes per token, FLOPs per token)


def recompute_costs(cfg: dict[str, Any], costs: list[LayerCost], attention: tuple[RecomputeModule, ...], *,
                    bytes_per_value: int) -> list[LayerCost]:
    """Each layer's selective-recompute modules (LayerCost.recompute_modules; parallel/recompute.py keeps a
    recomputed call's inputs, its output stays with the matmul reading it). `attention`: the attention's own,
    per token, from its family (llama_costs.gqa_recompute, deepseek_costs.mla_recompute; a "norm" there adds
    to the block's). Per token here: the block's two norms their normalized values (2C), an MLP activation
    silu(gate) (I), the experts' theirs per chosen expert (K I_e). FLOPs: a norm 4 values, an activation 5."""
    c, i = cfg["hidden_size"], cfg["intermediate_size"]
    m = moe_config(cfg)
    blocks = []
    for b, layer in enumerate(costs[1:-1]):
        mods = [("norm", 2 * c * bytes_per_value, 8.0 * c)]
        if m is not None and m.is_moe(b):
            width, shared = m.expert_width(i), m.shared_width(i)
            mods.append(("moe_act", m.top_k * width * bytes_per_value, 5.0 * m.top_k * width))
            if shared:
                mods.append(("mlp_act", shared * bytes_per_value, 5.0 * shared))
        else:
            mods.append(("mlp_act", i * bytes_per_value, 5.0 * i))
        blocks.append(dataclasses.replace(layer, recompute_modules=_merged((*mods, *attention))))
    head = dataclasses.replace(costs[-1], recompute_modules=(("norm", c * bytes_per_value, 4.0 * c),))
    return [costs[0], *blocks, head]


def _merged(mods: tuple[RecomputeModule, ...]) -> tuple[RecomputeModule, ...]:
    """One entry per module name, its bytes and FLOPs summed, in the order the names first come."""
    out: dict[str, RecomputeModule] = {}
    for name, saved, flops in mods:
        _, b, f = out.get(name, (name, 0, 0.0))
        out[name] = (name, b + saved, f + flops)
    return tuple(out.values())
