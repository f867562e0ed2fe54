"""The DeepSeek model schema: multi-head latent attention (MLA) blocks with DeepSeekMoE MLPs, the architecture of
DeepSeek-V2 (arXiv 2405.04434), DeepSeek-V3 (arXiv 2412.19437) and the models built on it (Kimi K2, Moonlight),
knobs named as HF's deepseek_v3 / deepseek_v2 config.json. The MoE half is config/moe.py's MoEConfig
(sigmoid scores, n_group / topk_group, the aux-free bias, shared experts, first_dense_layers =
first_k_dense_replace); `intermediate_size` is the dense-first blocks' MLP width, `moe.intermediate_size`
one routed expert's (moe_intermediate_size). Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from pipetrain.config.models import CausalLMConfig, read_pretrained_config, take_knobs
from pipetrain.config.moe import MoEConfig, keep_training_knobs

HF_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2")  # config.json model_type values DeepSeekModelConfig reads


@dataclass
class YarnScalingConfig:
    """HF config.json's `rope_scaling` of a YaRN model (Peng et al. 2023, arXiv 2309.00071), key for key;
    defaults are DeepSeek-V3's. transformers' _compute_yarn_parameters is what models/mla.py computes."""

    rope_type: str = "yarn"  # the only long-context scaling DeepSeek models use
    factor: float = 40.0  # the context is stretched by this
    original_max_position_embeddings: int = 4096  # the context the model was first trained at
    beta_fast: float = 32.0  # rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations below which a frequency is divided by factor (interpolated)
    mscale: float = 1.0  # cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 1.0  # the softmax scale times mscale(factor, mscale_all_dim)^2; 0: no correction

    def check(self) -> None:
        if self.rope_type != "yarn":
            raise ValueError(f"model.rope_scaling.rope_type={self.rope_type} is not supported by DeepSeek models: "
                             f"use yarn, or model.rope_scaling=null for plain RoPE")
        if not self.factor >= 1.0:
            raise ValueError(f"model.rope_scaling.factor must be >= 1 (got {self.factor})")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings must be >= 1 "
                             f"(got {self.original_max_position_embeddings})")
        if not 0 < self.beta_slow <= self.beta_fast:  # Kimi K2: both 1
            raise ValueError(f"model.rope_scaling needs 0 < beta_slow <= beta_fast (got {self.beta_slow} and "
                             f"{self.beta_fast})")
        if self.mscale < 0 or self.mscale_all_dim < 0:
            raise ValueError(f"model.rope_scaling.mscale and mscale_all_dim must be >= 0 (got {self.mscale} and "
                             f"{self.mscale_all_dim})")


def v3_moe() -> MoEConfig:
    """DeepSeek-V3's DeepSeekMoE: 256 routed experts of width 2048 (8 per token, sigmoid scores in 8 groups of
    which 4 may be used, renormalised, x 2.5), 1 shared expert, 3 dense-first blocks, aux-free balance."""
    return MoEConfig(num_experts=256, top_k=8, score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                     n_group=8, topk_group=4, balance="aux_free", num_shared_experts=1, intermediate_size=2048,
                     first_dense_layers=3)


@dataclass
class DeepSeekModelConfig(CausalLMConfig):
    """DeepSeek family (knobs named as HF's config.json). Defaults are DeepSeek-V3's main model (671B);
    conf/model/deepseek*.yaml, moonlight*.yaml and kimi*.yaml carry the presets."""

    name: str = "deepseek"
    vocab_size: int = 129280  # tokens in the embedding and the head
    hidden_size: int = 7168  # C
    intermediate_size: int = 18432  # the dense-first blocks' SwiGLU MLP width
    num_hidden_layers: int = 61  # decoder blocks
    num_attention_heads: int = 128  # H
    q_lora_rank: Optional[int] = 1536  # the query's low-rank compression; null: q_proj straight from C (V2-Lite)
    kv_lora_rank: int = 512  # the joint key/value latent's width (what an MLA KV cache holds per token)
    qk_nope_head_dim: int = 128  # per head: query/key dimensions without position (from the latent)
    qk_rope_head_dim: int = 64  # per head: query dimensions with RoPE; the key's are one head shared by all
    v_head_dim: int = 128  # per head: value dimensions
    rms_norm_eps: float = 1e-6  # the blocks' RMSNorms (the latents' norms keep 1e-6, as HF and DeepSeek's code)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Optional[YarnScalingConfig] = field(default_factory=YarnScalingConfig)  # null: plain RoPE
    rope_interleave: bool = True  # RoPE over interleaved pairs (DeepSeek's checkpoints); false: half-split
    tie_word_embeddings: bool = False  # lm_head shares the embedding's weight
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (HF's knob)
    max_position_embeddings: int = 163840  # longest sequence (bounds data.seq_len)
    moe: Optional[MoEConfig] = field(default_factory=v3_moe)  # DeepSeekMoE (config/moe.py); null: every MLP dense
    # a Hugging Face deepseek_v3 / deepseek_v2 folder (config.json, *.safetensors, bf16 or FP8 with block
    # scales): its config.json sets every shape knob above, its weights the initial ones (models/hf_deepseek.py)
    pretrained: Optional[str] = None
    family: ClassVar[str] = "deepseek"
    selective_recompute: ClassVar[bool] = True
    layer_knob: ClassVar[str] = "model.num_hidden_layers"
    seq_knob: ClassVar[str] = "max_position_embeddings"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # built from keyword arguments (models/deepseek.py)
            self.rope_scaling = YarnScalingConfig(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        self._take_mtp()
        self.pretrained_changes: list[str] = []  # knobs config.json changed: "hidden_size=64 (was 7168)"
        if self.pretrained is not None:
            path, raw = read_pretrained_config(self.pretrained)
            hf = deepseek_from_hf(raw, where=str(path))
            hf.moe = keep_training_knobs(hf.moe, self.moe)  # balance etc. stay this run's choice
            take_knobs(self, {f.name: getattr(hf, f.name) for f in dataclasses.fields(self)
                              if f.name not in ("name", "pretrained", "mtp")})  # mtp: this run's choice
        self._at_least_one("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                           "v_head_dim", "max_position_embeddings")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"model.q_lora_rank must be >= 1, or null for an uncompressed query (got "
                             f"{self.q_lora_rank})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even: RoPE rotates pairs of "
                             f"dimensions")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"model.rms_norm_eps and model.rope_theta must be > 0 "
                             f"(got {self.rms_norm_eps} and {self.rope_theta})")
        if self.rope_scaling is not None:
            self.rope_scaling.check()
        if self.moe is not None:
            self.moe.check_blocks(self.num_hidden_layers, knob="model.num_hidden_layers")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_config(self) -> Optional[MoEConfig]:
        return self.moe

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers + 2  # embedding, blocks, head (final norm + lm_head)

    def tp_divides(self) -> Optional[dict[str, int]]:
        """Heads split over tp (each rank its H/tp heads' q_b / q_proj, kv_b and o_proj slices); the
        compressions q_a_proj and kv_a_proj_with_mqa stay whole, as torchtitan and Megatron keep them, so
        q_lora_rank and kv_lora_rank need not divide. MoE blocks as the Llama family's (config/llama.py)."""
        out = {"num_attention_heads": self.num_attention_heads, "intermediate_size": self.intermediate_size,
               "vocab_size": self.vocab_size}
        if self.moe is not None:  # each expert (and the shared experts' MLP) split in its width, as the dense MLP
            out["moe.intermediate_size"] = self.moe.expert_width(self.intermediate_size)
            if self.moe.num_shared_experts:
                out["moe.shared_intermediate_size"] = self.moe.shared_width(self.intermediate_size)
        return out

    def knobs(self) -> dict[str, Any]:
        out = super().knobs()
        del out["pretrained"]  # where the weights come from, not the model's shape
        for knob in ("rope_scaling", "moe", "mtp"):  # plain dicts for the model (its config stays JSON-able)
            if getattr(self, knob) is not None:
                out[knob] = dataclasses.asdict(getattr(self, knob))
        return out


SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
         "max_position_embeddings")  # config.json keys read as they are


def deepseek_from_hf(hf: dict[str, Any], *, where: str) -> DeepSeekModelConfig:
    """The schema of an HF deepseek_v3 / deepseek_v2 config.json (transformers' DeepseekV3Config names; rope in
    the classic form or transformers 5's rope_parameters). DeepSeek-V2's group_limited_greedy scores a group by
    its best expert (group_score=max), V3's noaux_tc by its two best with the aux-free bias; greedy: no groups."""
    kind = hf.get("model_type")
    if kind not in HF_DEEPSEEK_TYPES:
        raise ValueError(f"{where}: model_type={kind!r} is not a DeepSeek model ({', '.join(HF_DEEPSEEK_TYPES)})")
    missing = [k for k in (*SHAPE, "n_routed_experts") if k not in hf]
    if missing:
        raise ValueError(f"model.pretrained: {where} lacks {missing[0]!r}, which pipetrain needs to build the "
                         f"model: copy it from the model's original config.json")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta", rope.pop("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **{
        f.name: rope[f.name] for f in dataclasses.fields(YarnScalingConfig) if f.name in rope}}
    method = hf.get("topk_method", "noaux_tc" if kind == "deepseek_v3" else "greedy")
    groups = method != "greedy"
    moe = MoEConfig(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                    score_func=hf.get("scoring_func", "sigmoid" if kind == "deepseek_v3" else "softmax"),
                    norm_topk_prob=hf.get("norm_topk_prob", kind == "deepseek_v3"),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    n_group=(hf.get("n_group") or 1) if groups else 1,
                    topk_group=(hf.get("topk_group") or 1) if groups else 1,
                    group_score="max" if method == "group_limited_greedy" else "top2",
                    balance="aux_free" if method == "noaux_tc" else "seq_aux_loss",
                    num_shared_experts=hf.get("n_shared_experts") or 0,
                    intermediate_size=hf["moe_intermediate_size"],
                    first_dense_layers=hf.get("first_k_dense_replace", 0))
    return DeepSeekModelConfig(
        name="pretrained", **{k: hf[k] for k in SHAPE},
        rope_theta=theta, rope_scaling=scaling, rope_interleave=hf.get("rope_interleave", True),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), attention_bias=hf.get("attention_bias", False),
        moe=moe)
