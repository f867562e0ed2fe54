"""Model schemas: one dataclass per model family, knobs named as the family's own config.

`knobs()` are the model constructor's keyword arguments (pipetrain.models.factory), so a
schema is also what the model checks its arguments against (models/llama.py builds a
LlamaModelConfig from its keyword arguments: one set of one-line errors for both paths).
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from pipetrain.config.moe import HF_MOE_TYPES, MoEConfig, keep_training_knobs, moe_from_hf


@dataclass
class ModelConfig:
    """Base of the model schemas. `knobs()` are the model constructor's keyword arguments
    (pipetrain.models.factory.build_model(family, **knobs)); `num_layers` is how many
    pipeline layers the model has, known without building it."""

    name: str = MISSING  # the model= option this config came from
    family: ClassVar[str] = ""  # factory name: "sleep", "mlp" or "gpt2" (every GPT-2 size)
    layer_knob: ClassVar[str] = ""  # the knob that sets the layer count, for error messages
    # Costs depend on data.batch_size (and data.seq_len where `has_seq`): the batch must then
    # split evenly into pipeline.microbatches even in mode=simulate.
    needs_batch: ClassVar[bool] = True
    has_seq: ClassVar[bool] = False
    seq_knob: ClassVar[str] = ""  # where has_seq: the knob bounding data.seq_len
    extra_layers: ClassVar[int] = 0  # pipeline layers besides the ones layer_knob counts

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def moe_config(self) -> Optional[MoEConfig]:
        """The Mixture-of-Experts knobs (config/moe.py) of a model with MoE blocks; None: every MLP dense."""
        return None

    def tp_divides(self) -> Optional[dict[str, int]]:
        """Knob -> value that parallel.tp must divide (the dimensions tensor parallel splits);
        None: the model has no tensor-parallel plan (models/tp_plan.py)."""
        return None

    def _at_least_one(self, *knobs: str) -> None:
        for knob in knobs:
            if getattr(self, knob) < 1:
                raise ValueError(f"model.{knob} must be >= 1 (got {getattr(self, knob)})")


@dataclass
class SleepModelConfig(ModelConfig):
    """Layers that take fixed times: the yardstick for schedule efficiency."""

    name: str = "sleep"
    layers: int = 16  # sleeping layers (one pipeline layer each)
    f_ms: float = 2.0  # forward time of one layer, one microbatch
    b_ms: float = 2.0  # input-gradient (B) time
    w_ms: float = 2.0  # weight-gradient (W) time
    hidden: int = 1024  # floats of activation each layer saves per sample
    # fp32 weights per layer: 1 keeps the model weightless in effect; millions give data
    # parallel real gradient bytes to reduce (bench/data_parallel_reduce.py)
    params_per_layer: int = 1
    family: ClassVar[str] = "sleep"
    layer_knob: ClassVar[str] = "model.layers"
    needs_batch: ClassVar[bool] = False  # a layer sleeps the same whatever the batch

    def __post_init__(self) -> None:
        self._at_least_one("layers", "hidden", "params_per_layer")
        for knob in ("f_ms", "b_ms", "w_ms"):
            if getattr(self, knob) < 0:
                raise ValueError(f"model.{knob} must be >= 0 ms (got {getattr(self, knob)})")

    @property
    def num_layers(self) -> int:
        return self.layers


@dataclass
class MLPModelConfig(ModelConfig):
    """A small stack of linear layers (tanh between them): real gradients, fastest to run."""

    name: str = "mlp"
    n_layer: int = 4  # linear layers (one pipeline layer each)
    d_in: int = 16  # input features
    d_hidden: int = 32  # width between layers
    d_out: int = 8  # regression outputs
    family: ClassVar[str] = "mlp"
    layer_knob: ClassVar[str] = "model.n_layer"

    def __post_init__(self) -> None:
        self._at_least_one("n_layer", "d_in", "d_hidden", "d_out")

    @property
    def num_layers(self) -> int:
        return self.n_layer


@dataclass
class CausalLMConfig(ModelConfig):
    """Base of the language models (models/causal_lm.py): token sequences in, an embedding and
    a head around the blocks `layer_knob` counts."""

    has_seq: ClassVar[bool] = True
    extra_layers: ClassVar[int] = 2  # the embedding and the head


GPT2_HF_SHAPE = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "vocab_size": "vocab_size",
                 "block_size": "n_positions"}  # pipetrain knob -> GPT2LMHeadModel config.json key
GPT2_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # HF's names for GPT-2's tanh-approximated GELU
GPT2_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, what pipetrain's GPT-2 uses


@dataclass
class GPT2ModelConfig(CausalLMConfig):
    """GPT-2 (knobs named as nanoGPT's GPTConfig). Defaults are the 124M model; the
    conf/model/gpt2*.yaml files carry pipetrain.models.gpt2.PRESETS (a test keeps them equal)."""

    name: str = "gpt2"
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width C
    vocab_size: int = 50257  # GPT-2's BPE vocabulary (unpadded, so parameter counts are the published ones)
    block_size: int = 1024  # longest sequence (learned position embeddings)
    dropout: float = 0.0  # 0 for pretraining, as nanoGPT; GPT-2 itself used 0.1
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2
    # A Hugging Face GPT2LMHeadModel folder (config.json + safetensors): its config.json sets n_layer,
    # n_head, n_embd, vocab_size and block_size (= n_positions); model.dropout stays yours
    pretrained: Optional[str] = None
    family: ClassVar[str] = "gpt2"
    layer_knob: ClassVar[str] = "model.n_layer"
    seq_knob: ClassVar[str] = "block_size"

    def __post_init__(self) -> None:
        self.pretrained_changes: list[str] = []  # knobs config.json changed: "n_embd=32 (was 768)"
        if self.pretrained is not None:
            path, raw = read_pretrained_config(self.pretrained)
            take_knobs(self, GPT2ModelConfig.from_hf(raw, where=f"model.pretrained: {path}"))
        self._at_least_one("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}: "
                f"change model.n_head to a divisor of {self.n_embd}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1) (got {self.dropout})")

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2  # embedding, n_layer blocks, head (final norm + output projection)

    def tp_divides(self) -> Optional[dict[str, int]]:
        return {"n_head": self.n_head, "vocab_size": self.vocab_size}  # MLP width 4 C = 4 n_head hs follows

    def knobs(self) -> dict[str, Any]:
        out = super().knobs()
        del out["pretrained"]  # where the weights come from, not the model's shape
        return out

    @staticmethod
    def from_hf(hf: dict[str, Any], *, where: str) -> dict[str, int]:
        """The shape knobs of a GPT2LMHeadModel config.json (`where` names it in errors); a setting
        pipetrain's GPT-2 does not compute is a one-line ValueError naming it. Dropout is not
        taken: it is a training choice (model.dropout), not the checkpoint's."""
        if hf.get("model_type") != "gpt2":
            raise ValueError(f"{where} has model_type={hf.get('model_type')!r}, not gpt2: a GPT-2 model (model=gpt2*) "
                             f"loads GPT2LMHeadModel folders; for a Llama-family folder use model=llama-tiny")
        missing = [key for key in GPT2_HF_SHAPE.values() if key not in hf]
        if missing:
            raise ValueError(f"{where} lacks {missing[0]!r}, which pipetrain needs to build the model: copy it from "
                             f"the model's original config.json")
        knobs = {knob: hf[key] for knob, key in GPT2_HF_SHAPE.items()}
        unsupported = (
            ("activation_function", hf.get("activation_function", "gelu_new") in GPT2_GELU_TANH, "gelu_new"),
            ("n_inner", hf.get("n_inner") in (None, 4 * knobs["n_embd"]), f"null (4 x n_embd = {4 * knobs['n_embd']})"),
            ("layer_norm_epsilon", hf.get("layer_norm_epsilon", GPT2_LAYER_NORM_EPS) == GPT2_LAYER_NORM_EPS,
             GPT2_LAYER_NORM_EPS),
            ("scale_attn_weights", hf.get("scale_attn_weights", True) is True, True),
            ("scale_attn_by_inverse_layer_idx", hf.get("scale_attn_by_inverse_layer_idx", False) is False, False),
            ("add_cross_attention", hf.get("add_cross_attention", False) is False, False),
            ("tie_word_embeddings", hf.get("tie_word_embeddings", True) is True, True),
        )
        for key, ok, want in unsupported:
            if not ok:
                raise ValueError(f"{where} sets {key}={hf[key]!r}, which pipetrain's GPT-2 does not compute "
                                 f"(it computes {key}={want})")
        return knobs


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
    layer_knob: ClassVar[str] = "model.num_hidden_layers"
    seq_knob: ClassVar[str] = "max_position_embeddings"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # built from keyword arguments (models/llama.py)
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
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
                          if f.name not in ("name", "pretrained")})

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
        if self.moe is not None or (self.qk_norm and not self.qk_norm_per_head):  # no plan for these yet
            return None
        return {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.kv_heads,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}

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
        return out


def read_pretrained_config(pretrained: str) -> tuple[Path, dict[str, Any]]:
    """model.pretrained's config.json, parsed; one line naming the file when it is missing or not
    a JSON object (a bare FileNotFoundError or JSONDecodeError names neither the knob nor the fix)."""
    path = Path(os.path.expanduser(str(pretrained))) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.pretrained={pretrained} must be a Hugging Face folder holding "
                                f"config.json and *.safetensors (no {path})")
    try:
        raw: Any = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raw = f"not JSON ({str(err).splitlines()[0]})"
    if not isinstance(raw, dict):
        raise ValueError(f"model.pretrained: {path} is {raw if isinstance(raw, str) else 'not a JSON object'}: "
                         f"download it again, or re-save the folder with save_pretrained")
    return path, raw


def take_knobs(model: Any, theirs: dict[str, Any]) -> None:
    """Set a model config's knobs to a pretrained folder's, noting each change in pretrained_changes."""
    for name, value in theirs.items():
        mine = getattr(model, name)
        if mine != value:
            model.pretrained_changes.append(f"{name}={_plain(value)} (was {_plain(mine)})")
            setattr(model, name, value)


def _plain(value: Any) -> Any:
    """A knob's value as config.json would spell it (rope_scaling: a dict)."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
