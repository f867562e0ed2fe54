"""Model schemas: one dataclass per model family, knobs named as the family's own config.

`knobs()` are the model constructor's keyword arguments (pipetrain.models.factory), so a
schema is also what the model checks its arguments against (models/llama.py builds a
LlamaModelConfig, config/llama.py, from its keyword arguments: one set of one-line errors for both paths).
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional


from pipetrain.config.moe import MoEConfig
from pipetrain.config.mtp import MTPConfig, mtp_of

# OmegaConf's "value missing" sentinel (omegaconf.MISSING is this string): spelt here so that the schemas, which
# the ranks import, do not import omegaconf (0.1 s of every rank's start; the CLI composes with it)
MISSING = "???"


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
    # its layers declare trainer.recompute=selective's modules (parallel/layer_spec.py RecomputePlanned;
    # tests/test_recompute.py checks each family's layers agree)
    selective_recompute: ClassVar[bool] = False

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}

    def resolved_knobs(self) -> dict[str, Any]:
        """`knobs()` with the defaults a family works out filled in: the built model's `config`, what its
        cost model reads (models/costs.py)."""
        return self.knobs()

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    # What the rest of pipetrain reads of every model, declared here so that no reader guesses with
    # getattr: each family answers in its own knobs' terms (a dataclass field of the same name
    # in a family, GPT-2's and Llama's vocab_size and pretrained, takes the property's place).
    @property
    def hidden_size(self) -> int:
        """The width C of the activation crossing a stage boundary (values per token): what tensor
        parallel's collectives and the planner's point-to-point bytes are sized by."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> Optional[int]:
        """Tokens in the embedding and the head; None: the model reads no token ids."""
        return None

    @property
    def pretrained(self) -> Optional[str]:
        """A Hugging Face folder the weights (and shape) come from; None: seeded initial weights."""
        return None

    @property
    def moe_config(self) -> Optional[MoEConfig]:
        """The Mixture-of-Experts knobs (config/moe.py) of a model with MoE blocks; None: every MLP dense."""
        return None

    @property
    def mtp_config(self) -> MTPConfig:
        """Multi-token prediction (config/mtp.py): depth 0 (off) for a model that has none."""
        return MTPConfig()

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

    @property
    def hidden_size(self) -> int:
        return self.hidden  # what a sleeping layer saves and passes on per sample


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

    @property
    def hidden_size(self) -> int:
        return self.d_hidden  # the width between layers


@dataclass
class CausalLMConfig(ModelConfig):
    """Base of the language models (models/causal_lm.py): token sequences in, an embedding and
    a head around the blocks `layer_knob` counts."""

    # multi-token prediction (DeepSeek-V3 §2.2, config/mtp.py): model.mtp.depth, model.mtp.loss_weight
    mtp: MTPConfig = field(default_factory=MTPConfig)
    has_seq: ClassVar[bool] = True
    extra_layers: ClassVar[int] = 2  # the embedding and the head

    @property
    def mtp_config(self) -> MTPConfig:
        return self.mtp

    def _take_mtp(self) -> None:
        """model.mtp as given (a dict where the model is built from its knobs), checked."""
        self.mtp = mtp_of(self.mtp)


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
        self._take_mtp()
        if self.mtp.depth:
            raise ValueError(f"model.mtp.depth={self.mtp.depth}: GPT-2 has no multi-token prediction module: set "
                             f"model.mtp.depth=0, or use a Llama-family model (model=llama-tiny, model=moe-tiny)")
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

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    def tp_divides(self) -> Optional[dict[str, int]]:
        return {"n_head": self.n_head, "vocab_size": self.vocab_size}  # MLP width 4 C = 4 n_head hs follows

    def knobs(self) -> dict[str, Any]:
        out = super().knobs()
        del out["pretrained"], out["mtp"]  # where the weights come from, not the model's shape; no MTP (depth 0)
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
