"""The DeepSeek family (DeepSeek-V2/V3, Kimi K2, Moonlight) as an ordered list of pipeline layers.

Maths as transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM compute it (our own code): Llama's
pre-norm blocks (models/llama.py: RMSNorm, SwiGLU MLP, embedding, head) with multi-head latent attention
(models/mla.py) in place of grouped-query attention, the first `moe.first_dense_layers` blocks with a dense
MLP of intermediate_size and DeepSeekMoE after (models/moe_block.py: sigmoid or softmax scores, group-limited
routing, the aux-free bias, shared experts; config/moe.py). DeepSeek-V2's routing differs from V3's only in
the knobs (softmax scores, no renormalisation, a group scored by its best expert: group_score=max).

Layers (causal_lm.py): 0 = embedding, 1..L = decoder blocks, L + 1 = head (norm + lm_head); parameter
names are HF's shifted by the embedding's layer, as the Llama family's (`layers.{i+1}.self_attn.kv_b_proj`
is HF's `model.layers.{i}.self_attn.kv_b_proj`). Multi-token prediction (DeepSeek-V3 §2.2) is a block of
`decoder_block`'s making after the head's norm: `DeepSeek.block` builds one with this model's knobs.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pipetrain.config.deepseek import DeepSeekModelConfig
from pipetrain.config.moe import MoEConfig
from pipetrain.models.decoder_costs import AttentionCost, decoder_param_count
from pipetrain.models.llama import MLP, DecoderLayer, Llama, Rotary
from pipetrain.models.mla import MLA, YarnRotary, softmax_scale
from pipetrain.parallel.layer_spec import Column, TPLayerPlan
from pipetrain.partition.costs import LayerCost


class MLABlock(DecoderLayer):
    """A decoder block with MLA attention: Llama's block contract (documents, nodes, cp and ep plans) with
    its own tensor-parallel plan."""

    def tp_plan(self) -> TPLayerPlan:
        """Heads split (q_b_proj or q_proj, kv_b_proj column-parallel, o_proj row-parallel), the compressions
        whole: their weights and norms see this rank's heads' gradient only (`partial`, summed over tp)."""
        if not isinstance(self.mlp, MLP):
            raise ValueError(f"parallel.tp: no tensor-parallel plan for a {type(self.mlp).__name__} MLP: set "
                             f"parallel.tp=1, or model.moe=null for dense MLA blocks")
        attn = self.self_attn
        assert isinstance(attn, MLA)
        q = "self_attn.q_b_proj" if attn.compressed_q else "self_attn.q_proj"
        whole = tuple(f"self_attn.{n}" for n, _ in attn.named_parameters() if n.startswith(("q_a_", "kv_a_")))
        partial_sp = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        partial_sp += ["self_attn.o_proj.bias"] if attn.o_proj.bias is not None else []
        return TPLayerPlan(
            regions=("self_attn", "mlp"),
            column=tuple(Column(p) for p in (q, "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj")),
            row=("self_attn.o_proj", "mlp.down_proj"), head_counts=(("self_attn", "heads"),),
            partial=whole, partial_sp=tuple(partial_sp))


def decoder_block(args: DeepSeekModelConfig, rotary: Rotary, *, moe: Optional[MoEConfig]) -> MLABlock:
    """One MLA block of the model `args` describes (`moe`: its MoE knobs, None: the dense MLP)."""
    scaling = None if args.rope_scaling is None else vars(args.rope_scaling)
    attention = MLA(hidden=args.hidden_size, heads=args.num_attention_heads, q_lora_rank=args.q_lora_rank,
                    kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
                    qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
                    attention_bias=args.attention_bias, rotary=rotary, rope_interleave=args.rope_interleave,
                    scale=softmax_scale(args.qk_head_dim, scaling))
    return MLABlock(hidden=args.hidden_size, intermediate=args.intermediate_size, eps=args.rms_norm_eps, moe=moe,
                    attention=attention)


class DeepSeek(Llama):
    """Knobs as DeepSeekModelConfig (HF config.json names); `seed` draws the initial weights. Llama's
    initialization (N(0, 0.02), depth-scaled o_proj / down_proj / experts.w2, unit norms, zero biases) and
    interface; MLA blocks."""

    def __init__(self, *, seed: int = 0, **knobs: Any) -> None:
        nn.Module.__init__(self)  # Llama's interface, not its grouped-query blocks
        self._args = args = DeepSeekModelConfig(name="deepseek", **knobs)  # one-line errors naming the knob
        self._config = args.knobs()
        c, v, n = args.hidden_size, args.vocab_size, args.num_hidden_layers
        self._set_shape(width=c, vocab=v, blocks=n, max_seq=args.max_position_embeddings,
                        max_seq_knob="max_position_embeddings")
        self.rotary = YarnRotary(args.qk_rope_head_dim, args.rope_theta, self._config["rope_scaling"])
        self.assemble([self.block(i) for i in range(n)], tie=args.tie_word_embeddings, eps=args.rms_norm_eps,
                      mtp=args.mtp, seed=seed)

    def block(self, index: int) -> MLABlock:
        """Decoder block `index`'s shape (dense or MoE MLP by model.moe), sharing the model's RoPE tables."""
        moe = self._args.moe
        return decoder_block(self._args, self.rotary, moe=moe if moe is not None and moe.is_moe(index) else None)

    def attention_cost(self, seq: int) -> AttentionCost:
        return mla_attention(self._config, seq=seq)

    def selective_costs(self, costs: list[LayerCost], seq: int) -> list[LayerCost]:
        return costs  # MLA's blocks declare no selective-recompute modules yet (mla_up: a later change)


# ---- sizes and costs (pure arithmetic over the resolved config) ------------------------------


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

