"""The Llama-family model schema: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and the MoE models built on them
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), knobs named as HF's config.json (config/models.py: the base
schema, GPT-2's, and reading a pretrained folder's config.json). Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from pipetrain.config.models import CausalLMConfig, read_pretrained_config, take_knobs
from pipetrain.config.moe import HF_MOE_TYPES, MoEConfig, keep_training_knobs, moe_from_hf


# Rotary scalings the Llama model implements: plain RoPE and Llama 3.1's long-context recipe.
ROPE_TYPES = ("default", "llama3")
# HF config.json model_type values LlamaModelConfig.from_hf reads (qwen2: q, k, v biases; qwen3: QK-norm;
# the MoE ones: config/moe.py moe_from_hf)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *HF_MOE_TYPES)
QKV_BIAS_TYPES, QK_NORM_TYPES = ("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe", "olmoe")


@dataclass
class RopeScalingConfig:
    """HF config.json's `rope_scaling`, key for key; defaults are Llama 3.1's (3.2 uses factor 32).

    A typed nested node rather than a free dict or flattened knobs: a preset reads like the
    model's config.json, a misspelled key or a wrong type fails at composition,
    `model.rope_scaling.factor=16` overrides one number, `model.rope_scaling=null` means plain
    RoPE, and a checkpoint's dict converts with RopeScalingConfig(**d)."""

    rope_type: str = "llama3"  # llama3: Llama 3.1's frequency-dependent scaling
    factor: float = 8.0  # long wavelengths are stretched by this
    low_freq_factor: float = 1.0  # wavelengths > original / low_freq_factor: divided by factor
    high_freq_factor: float = 4.0  # wavelengths < original / high_freq_factor: kept
    original_max_position_embeddings: int = 8192  # the context the model was first trained at

    def check(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_scaling.rope_type={self.rope_type} is not supported: use llama3, "
                             f"or model.rope_scaling=null for plain RoPE")
        if not self.factor >= 1.0:
            raise ValueError(f"model.rope_scaling.factor must be >= 1 (got {self.factor})")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor "
                             f"(got {self.low_freq_factor} and {self.high_freq_factor})")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings must be >= 1 "
                             f"(got {self.original_max_position_embeddings})")


@dataclass
class LlamaModelConfig(CausalLMConfig):
    """Llama family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (knobs named as HF's config.json;
    `qkv_bias` and `qk_norm` are what HF's model_type qwen2 and qwen3 imply). Defaults are
    Llama-3.2-1B; conf/model/llama*.yaml, qwen*.yaml, mistral*.yaml carry the presets."""

    name: str = "llama"
    vocab_size: int = 128256  # tokens in the embedding and the head
    hidden_size: int = 2048  # C
    intermediate_size: int = 8192  # the SwiGLU MLP's width
    num_hidden_layers: int = 16  # decoder blocks
    num_attention_heads: int = 32  # query heads H
    num_key_value_heads: Optional[int] = 8  # KV: grouped-query attention; null = H (multi-head)
    head_dim: Optional[int] = None  # null = hidden_size / H (Qwen3 sets it apart)
    rms_norm_eps: float = 1e-5  # RMSNorm's denominator guard
    rope_theta: float = 500000.0  # RoPE base
    rope_scaling: Optional[RopeScalingConfig] = field(default_factory=lambda: RopeScalingConfig(factor=32.0))
    tie_word_embeddings: bool = True  # lm_head shares the embedding's weight
    attention_bias: bool = False  # biases on q, k, v and o (HF Llama's knob)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2 / 2.5)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    qk_norm_per_head: bool = True  # false: QK-norm over all heads' q (and k) at once, before the head split (OLMoE)
    max_position_embeddings: int = 131072  # longest sequence (bounds data.seq_len)
    moe: Optional[MoEConfig] = None  # Mixture-of-Experts blocks (config/moe.py); null: every MLP dense
    # A Hugging Face folder (config.json + safetensors): its config.json sets every knob above
    # (it wins over the preset and the command line; `pretrained_changes` lists what it changed)
    # and each rank reads its stages' weights from its safetensors (models/hf.py).
    pretrained: Optional[str] = None
    family: ClassVar[str] = "llama"
    selective_recompute: ClassVar[bool] = True
    layer_knob: ClassVar[str] = "model.num_hidden_layers"
    seq_knob: ClassVar[str] = "max_position_embeddings"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # built from keyword arguments (models/llama.py)
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        self._take_mtp()
        self.pretrained_changes: list[str] = []  # knobs config.json changed: "hidden_size=64 (was 128)"
        if self.pretrained is not None:
            self._take_pretrained_shape()
        self._at_least_one("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings")
        h, kv = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % h:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by "
                             f"model.num_attention_heads={h}: change model.num_attention_heads to a divisor of "
                             f"{self.hidden_size}, or set model.head_dim")
        if kv < 1 or h % kv:
            raise ValueError(f"model.num_attention_heads={h} must be a multiple of model.num_key_value_heads={kv} "
                             f"(each key/value head serves H/KV query heads): set model.num_key_value_heads to a "
                             f"divisor of {h}")
        if self.head_size < 2 or self.head_size % 2:
            size = (f"model.head_dim={self.head_dim}" if self.head_dim is not None else
                    f"the head size model.hidden_size / model.num_attention_heads = {self.head_size}")
            raise ValueError(f"{size} must be even and >= 2: RoPE rotates pairs of dimensions")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"model.rms_norm_eps and model.rope_theta must be > 0 "
                             f"(got {self.rms_norm_eps} and {self.rope_theta})")
        if self.attention_bias and self.qkv_bias:
            raise ValueError("model.qkv_bias adds nothing when model.attention_bias=true (it biases q, k, v and o): "
                             "drop model.qkv_bias")
        if self.rope_scaling is not None:
            self.rope_scaling.check()
        if self.moe is not None:
            self.moe.check_blocks(self.num_hidden_layers, knob="model.num_hidden_layers")

    def _take_pretrained_shape(self) -> None:
        """Every knob from the folder's config.json; what that changes is kept for one note."""
        path, raw = read_pretrained_config(self.pretrained)
        try:
            hf = LlamaModelConfig.from_hf(raw, name=self.name)
        except KeyError as err:
            raise ValueError(f"model.pretrained: {path} lacks {err.args[0]!r}, which pipetrain needs to build the "
                             f"model: copy it from the model's original config.json") from None
        hf.moe = keep_training_knobs(hf.moe, self.moe)  # balance etc. stay this run's choice
        take_knobs(self, {f.name: getattr(hf, f.name) for f in dataclasses.fields(self)
                          if f.name not in ("name", "pretrained", "mtp")})  # mtp: this run's choice

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim

    @property
    def moe_config(self) -> Optional[MoEConfig]:
        return self.moe

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers + 2  # embedding, blocks, head (final norm + lm_head)

    def tp_divides(self) -> Optional[dict[str, int]]:
        if self.qk_norm and not self.qk_norm_per_head:  # no plan for this yet
            return None
        out = {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.kv_heads,
               "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}
        if self.moe is not None:  # each expert (and the shared experts' MLP) split in its width, as the dense MLP
            out["moe.intermediate_size"] = self.moe.expert_width(self.intermediate_size)
            if self.moe.num_shared_experts:
                out["moe.shared_intermediate_size"] = self.moe.shared_width(self.intermediate_size)
        return out

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, name: str = "pretrained") -> LlamaModelConfig:
        """The schema of an HF config.json (model_type llama, mistral, qwen2 or qwen3), in the
        classic form (rope_theta + rope_scaling) or transformers 5's (rope_parameters)."""
        kind = hf.get("model_type")
        if kind not in HF_MODEL_TYPES:
            raise ValueError(f"config.json model_type={kind!r} is not a Llama-family model pipetrain builds: "
                             f"it builds {', '.join(HF_MODEL_TYPES)}")
        for key, ok in (("hidden_act", "silu"), ("mlp_bias", False), ("use_sliding_window", False)):
            if hf.get(key, ok) != ok:
                raise ValueError(f"config.json {key}={hf[key]!r} is not supported (pipetrain builds {key}={ok!r})")
        if kind in ("mistral", "mixtral") and hf.get("sliding_window") is not None:
            raise ValueError(f"config.json sliding_window={hf['sliding_window']} is not supported: pipetrain's "
                             f"attention is full causal (Mistral v0.3 and later set it to null)")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **{
            k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if k in rope}}
        return cls(
            name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"), rms_norm_eps=hf["rms_norm_eps"], rope_theta=float(theta),
            rope_scaling=scaling, tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=kind not in QKV_BIAS_TYPES and hf.get("attention_bias", False),
            qkv_bias=kind in QKV_BIAS_TYPES, qk_norm=kind in QK_NORM_TYPES, qk_norm_per_head=kind != "olmoe",
            max_position_embeddings=hf["max_position_embeddings"], moe=moe_from_hf(hf),
        )

    def knobs(self) -> dict[str, Any]:
        out = super().knobs()
        del out["pretrained"]  # where the weights come from, not the model's shape
        if self.rope_scaling is not None:  # a plain dict for the model (its config stays JSON-able)
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.moe is not None:
            out["moe"] = dataclasses.asdict(self.moe)
        out["mtp"] = dataclasses.asdict(self.mtp)
        return out

    def resolved_knobs(self) -> dict[str, Any]:
        return {**self.knobs(), "num_key_value_heads": self.kv_heads, "head_dim": self.head_size}
