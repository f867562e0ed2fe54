"""Hugging Face deepseek_v3 / deepseek_v2 folders: what differs from the Llama family's (models/hf.py).

- Keys: the Llama family's (llama.hf_name: MLA's submodules are named as transformers' DeepseekV3Attention),
  DeepSeekMoE's in hf_moe.py (per expert, `mlp.shared_experts.*`, the aux-free bias as DeepSeek-V3's
  `mlp.gate.e_score_correction_bias`).
- The MTP layers (DeepSeek-V3's release, which transformers ignores: `model.layers.{N+j}.` with `eh_proj`,
  `enorm`, `hnorm`, `shared_head.norm`, the block's keys, and copies of the embedding `embed_tokens` and of the
  output head `shared_head.head`): read where the run has model.mtp.depth > j (models/mtp.py mtp_hf_key), the
  copies read as the main weights they are here (one Parameter each) and written again by mode=export; the
  layers beyond the run's depth are ignored (a folder loads at model.mtp.depth=0 too).
- FP8 (the official DeepSeek-V3 release): matmul weights stored as float8_e4m3fn, each beside
  `<key>_scale_inv`, float32, one per 128 x 128 block (ceil(R/128) x ceil(C/128)); the weight is
  weight * scale blockwise, dequantized on read to fp32 (then the run's dtype). An FP8 weight without its
  scales is refused in one line before any rank starts (`check_scales`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipetrain.config.deepseek import DeepSeekModelConfig

FP8 = "F8_E4M3"  # safetensors' dtype name of torch.float8_e4m3fn
FP8_BLOCK = 128  # DeepSeek-V3's quantization block (config.json quantization_config.weight_block_size)
SCALE = "_scale_inv"
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the main embedding and lm_head, stored again


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 weight (R, C) of an FP8 one and its (ceil(R/block), ceil(C/block)) scales: weight * scale per block."""
    r, c = weight.shape
    per_value = scale.float().repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]  # (R, C)
    return weight.float() * per_value


def check_scales(where: str, dtypes: dict[str, str]) -> None:
    """One line for an FP8 weight (`dtypes`: HF key -> safetensors dtype) without its block scales."""
    bare = sorted(k for k, d in dtypes.items() if d == FP8 and k + SCALE not in dtypes)
    if bare:
        raise ValueError(f"{where}: {bare[0]} is float8_e4m3fn without {bare[0]}{SCALE} ({len(bare)} FP8 weight(s) "
                         f"without scales): pipetrain dequantizes FP8 with DeepSeek-V3's 128x128 block scales; "
                         f"download the folder with its *{SCALE} tensors or convert it to bf16")


def ignored(key: str, *, num_hidden_layers: int, depth: int) -> bool:
    """A folder key that is no weight of the run's model: a block scale (read beside its weight), an MTP layer
    beyond model.mtp.depth, or an MTP layer's copy of the embedding or head."""
    if key.endswith(SCALE):
        return True
    parts = key.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    j = int(parts[2]) - num_hidden_layers
    return j >= depth or (j >= 0 and parts[3] in MTP_COPIES)


def mtp_copies(*, num_hidden_layers: int, depth: int) -> dict[str, str]:
    """Export: HF key of each MTP layer's copy -> the main weight's key it repeats (as the release stores them)."""
    out = {}
    for j in range(num_hidden_layers, num_hidden_layers + depth):
        out.update({f"model.layers.{j}.embed_tokens.weight": "model.embed_tokens.weight",
                    f"model.layers.{j}.shared_head.head.weight": "lm_head.weight"})
    return out


def hf_config(cfg: DeepSeekModelConfig, *, dtype: str) -> dict[str, Any]:
    """config.json of transformers' DeepseekV3ForCausalLM computing `cfg` (mode=export without a pretrained
    folder; with one, models/hf.py writes the folder's own, FP8's quantization_config dropped)."""
    moe = cfg.moe
    if moe is None or moe.score_func != "sigmoid" or moe.group_score != "top2" or not moe.norm_topk_prob:
        raise ValueError("mode=export: transformers' DeepseekV3ForCausalLM routes MoE blocks by sigmoid scores, "
                         "renormalised, groups scored by their two best experts: set model.moe to DeepSeek-V3's "
                         "routing (model=deepseek-tiny's)")
    rope = None if cfg.rope_scaling is None else dataclasses.asdict(cfg.rope_scaling)
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
        initializer_range=0.02, use_cache=True, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=moe.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, n_shared_experts=moe.num_shared_experts,
        n_routed_experts=moe.num_experts, routed_scaling_factor=moe.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=moe.n_group,
        topk_group=moe.topk_group, num_experts_per_tok=moe.top_k, first_k_dense_replace=moe.first_dense_layers,
        norm_topk_prob=True, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=rope,
        rope_interleave=cfg.rope_interleave, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias, attention_dropout=0.0,
        max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=cfg.mtp.depth,
        torch_dtype=dtype)
