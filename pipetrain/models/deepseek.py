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
from pipetrain.models.llama import DecoderLayer, Llama, Rotary, mlp_tp_plan
from pipetrain.models.mla import MLA, YarnRotary, softmax_scale
from pipetrain.parallel.layer_spec import Column, TPLayerPlan


class MLABlock(DecoderLayer):
    """A decoder block with MLA attention: Llama's block contract (documents, nodes, cp and ep plans) with
    its own tensor-parallel and selective-recompute plans."""

    def recompute_plan(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        """Llama's modules (the block's two norms, core attention: RoPE and SDPA, the MLP's activations) and
        MLA's up-projections with the latent norms before them (mla_up, as Megatron's mla_up_proj; their
        weights differentiated in B: parallel/recompute.py). The latent norms are mla_up's, not norm's."""
        attn = self.self_attn
        assert isinstance(attn, MLA)
        return {**super().recompute_plan(), "mla_up": (("self_attn", "up", *attn.up_weights()),)}

    def tp_plan(self) -> TPLayerPlan:
        """Heads split (q_b_proj or q_proj, kv_b_proj column-parallel, o_proj row-parallel), the compressions
        whole: their weights and norms see this rank's heads' gradient only (`partial`, summed over tp). The MLP
        as Llama's (models/llama.py mlp_tp_plan): dense, or DeepSeekMoE's experts and shared experts."""
        attn = self.self_attn
        assert isinstance(attn, MLA)
        q = "self_attn.q_b_proj" if attn.compressed_q else "self_attn.q_proj"
        whole = tuple(f"self_attn.{n}" for n, _ in attn.named_parameters() if n.startswith(("q_a_", "kv_a_")))
        partial_sp = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        partial_sp += ["self_attn.o_proj.bias"] if attn.o_proj.bias is not None else []
        mlp = mlp_tp_plan(self.mlp)
        return TPLayerPlan(
            regions=("self_attn", *mlp.regions),
            column=(Column(q), Column("self_attn.kv_b_proj"), *mlp.column),
            row=("self_attn.o_proj", *mlp.row), experts=mlp.experts, head_counts=(("self_attn", "heads"),),
            partial=whole, partial_sp=(*partial_sp, *mlp.partial_sp))


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

    family = "deepseek"

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
