"""Hugging Face folders in and out: config.json, and safetensors in one file (model.safetensors)
or in shards listed by model.safetensors.index.json; keys are HF's names (llama.hf_name).

In (`model.pretrained=DIR`): `check_folder` runs once before any rank starts and reads only
the files' headers (the first bytes: key, dtype, shape), so a missing, extra or mis-shaped key
fails in one line naming it, and so does a file that is not what it claims (a git-lfs
pointer, a shard shorter than its header says, an index that is not JSON), naming the file. Each
rank then materializes its stages from `PretrainedWeights`, an init rule (models/init.py) that reads
one tensor at a time with safetensors' `safe_open`, opening a file only when one of the rank's own
keys lives in it (the index's weight_map says which): a rank holding blocks 0-3 of a 16-shard
checkpoint opens the shards holding those. Under expert parallel a rank reads only its own experts
(`init_block`: materialize asks for the rows it keeps), and `read` counts the bytes this process
read, per HF key.

A tied head (tie_word_embeddings) is the embedding: a folder has no lm_head.weight then (as
save_pretrained writes it); one that has it anyway has it ignored. Out (`mode=export`):
`hf_config` is the config.json transformers reads back; train/export.py writes the tensors.

Three families: the Llama family (keys: llama.hf_name), DeepSeek (its keys, MTP layers and FP8 block
scales: hf_deepseek.py) and GPT-2 (GPT2LMHeadModel folders: hf_gpt2.py, whose Conv1D weights are stored
transposed). `HFNames` is what differs between them.
MoE blocks of the Llama family (Mixtral, Qwen2/3-MoE, OLMoE) stack their experts: one weight is
several HF tensors, or part of one, in either on-disk layout (hf_moe.py: `pieces`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from pipetrain.config.deepseek import DeepSeekModelConfig
from pipetrain.config.llama import LlamaModelConfig
from pipetrain.config.models import GPT2ModelConfig, ModelConfig, read_pretrained_config
from pipetrain.models import hf_deepseek, hf_gpt2
from pipetrain.models.base import LayeredModel
from pipetrain.models.deepseek import DeepSeek
from pipetrain.models.gpt2 import GPT2
from pipetrain.models.hf_moe import MoEKeys, Piece, assemble, hf_moe_config, to_hf
from pipetrain.models.llama import Llama, hf_name

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# Tokenizer (and generation) files copied into an exported folder when the source holds them.
# What mode=export copies beside the weights; chat_template.jinja: where transformers >= 4.43 saves a
# tokenizer's chat template (chat_template.json: a processor's)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")
LEGACY_KEYS = (".rotary_emb.inv_freq",)  # RoPE tables older checkpoints saved: derived, not weights
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def folder_of(pretrained: str) -> Path:
    return Path(os.path.expanduser(pretrained))


def weight_map(folder: Path) -> dict[str, str]:
    """HF key -> the file (name inside `folder`) holding it: the index's weight_map, or every
    key of the single model.safetensors (its header)."""
    if (folder / INDEX).is_file():
        index = read_json(folder / INDEX)
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{folder / INDEX} has no weight_map: re-save the folder with save_pretrained "
                             f"(or download the index again)")
        return dict(index["weight_map"])
    if (folder / WEIGHTS).is_file():
        return {k: WEIGHTS for k in read_header(folder / WEIGHTS)}
    raise FileNotFoundError(f"model.pretrained={folder} has no {WEIGHTS} and no {INDEX}: save the model with "
                            f"save_pretrained(..., safe_serialization=True) (pipetrain reads safetensors only)")


LFS = b"version https://git-lfs"  # how a git-lfs pointer file starts (what a clone without git lfs holds)
AGAIN = "download it again (e.g. huggingface-cli download, or git lfs pull in its folder)"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a one-line ValueError naming the file."""
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        what = "a git-lfs pointer" if path.read_bytes().startswith(LFS) else f"not JSON ({str(err).splitlines()[0]})"
        raise ValueError(f"{path} is {what}: {AGAIN}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object: {AGAIN}")
    return data


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """key -> {"dtype", "shape", "data_offsets"} of a safetensors file, reading only its header
    (an 8-byte little-endian length, then that many bytes of JSON). A file that is not one, or
    shorter than its header says (a download cut off), is a one-line ValueError naming it: read
    blindly, a git-lfs pointer's first 8 bytes ask for a header of 10^19 bytes (MemoryError)."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if head.startswith(LFS[:8]) and f.read(len(LFS) - 8) == LFS[8:]:
            raise ValueError(f"{path} is a git-lfs pointer, not the weights: {AGAIN}")
        try:
            header = json.loads(f.read(size)) if 0 < size <= total - 8 else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file ({total} bytes, no readable header): {AGAIN}")
    header.pop("__metadata__", None)
    try:
        end = 8 + size + max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (KeyError, TypeError, IndexError, ValueError):
        raise ValueError(f"{path} is not a safetensors file (its header lists no data_offsets): {AGAIN}") from None
    if total < end:
        raise ValueError(f"{path} is truncated ({total} bytes; its header lists tensors up to byte {end}): {AGAIN}")
    return header


def _same(key: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class HFNames:
    """How one model family's parameters are stored in an HF folder."""

    key: Callable[[str], str]  # pipetrain's unsplit parameter name -> the HF key
    tied: bool  # the head is the embedding: a folder's lm_head.weight is never read
    # (HF key, tensor) -> the tensor in the other side's layout (GPT-2's Conv1D: a transpose, its own inverse)
    layout: Callable[[str, torch.Tensor], torch.Tensor] = _same
    legacy: tuple[str, ...] = LEGACY_KEYS  # suffixes of keys that are derived buffers, not weights
    moe: Optional[MoEKeys] = None  # how the folder stores MoE blocks (None: the model has none)
    ignored: Callable[[str], bool] = lambda key: False  # folder keys that are no weight (hf_deepseek.ignored)
    copies: dict[str, str] = dataclasses.field(default_factory=dict)  # export: key written again as another

    def pieces(self, name: str, shape: tuple[int, ...]) -> Optional[list[Piece]]:
        """The HF tensors of an MoE block's weight `name` (hf_moe.py); None: an ordinary one-key weight."""
        if self.moe is None or ".mlp." not in name:
            return None
        return self.moe.pieces(self.key(name).partition(".mlp.")[0], name.partition(".mlp.")[2], shape)

    def to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Export: HF key -> tensor of pipetrain's weights (an MoE weight: one per expert, or fused, its
        w1 and w3 then in one gate_up_proj: `tensors` must hold both)."""
        out: dict[str, torch.Tensor] = {}
        moe: dict[str, tuple[list[Piece], torch.Tensor]] = {}
        for name, tensor in tensors.items():
            pieces = self.pieces(name, tuple(tensor.shape))
            if pieces is None:
                out[self.key(name)] = self.layout(self.key(name), tensor)
            else:
                moe[name] = (pieces, tensor)
        out.update(to_hf(moe))
        return {**out, **{copy: out[key].clone() for copy, key in self.copies.items() if key in out}}


def names_of(knobs: dict[str, Any], keys: Iterable[str] = (), model_type: Optional[str] = None, *,
             fused: bool = False) -> HFNames:
    """The HFNames of a model from its constructor arguments (a model's `config`, or a model
    config's `knobs()`); `keys` are the folder's, whose prefix GPT-2's names follow (none given:
    GPT2LMHeadModel's "transformer.", what an export writes) and whose MoE layout is read; an
    export passes its config.json's `model_type` instead (Mixtral's per-expert names differ) and
    `fused` (export.moe_layout=fused: transformers 5's gate_up_proj / down_proj)."""
    if "n_layer" in knobs:  # GPT-2
        keys = list(keys)
        prefix = hf_gpt2.prefix_of(keys) if keys else hf_gpt2.PREFIX
        return HFNames(partial(hf_gpt2.hf_key, n_layer=knobs["n_layer"], prefix=prefix), tied=True,
                       layout=hf_gpt2.swap_layout, legacy=hf_gpt2.LEGACY_KEYS)
    if "kv_lora_rank" in knobs:  # DeepSeek (hf_deepseek.py)
        n, depth, keys = knobs["num_hidden_layers"], (knobs.get("mtp") or {}).get("depth", 0), list(keys)
        bias = any(k.endswith(".e_score_correction_bias") for k in keys) if keys else model_type == "deepseek_v3"
        return HFNames(partial(hf_name, num_hidden_layers=n), tied=knobs["tie_word_embeddings"],
                       moe=MoEKeys(deepseek=True, bias=bias) if knobs.get("moe") else None,
                       ignored=partial(hf_deepseek.ignored, num_hidden_layers=n, depth=depth),
                       copies=hf_deepseek.mtp_copies(num_hidden_layers=n, depth=depth))
    if "num_hidden_layers" in knobs:  # the Llama family
        return HFNames(partial(hf_name, num_hidden_layers=knobs["num_hidden_layers"]),
                       tied=knobs["tie_word_embeddings"],
                       moe=(MoEKeys.of(keys) if keys else MoEKeys(fused=fused, mixtral=model_type == "mixtral"))
                       if knobs.get("moe") else None)
    raise ValueError(f"a model with knobs {sorted(knobs)} has no Hugging Face form: use a GPT-2 or Llama-family model")


def expected_shapes(model: LayeredModel, names: HFNames) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every distinct weight of `model` (built on meta is enough) in HF's
    layout; a tied head is the embedding, so lm_head.weight is absent then. An MoE weight gives
    its pieces' keys (each expert's, or the fused tensor's) and none for the aux_free bias."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        pieces = names.pieces(name, tuple(p.shape))
        if pieces is None:
            out[names.key(name)] = tuple(names.layout(names.key(name), p).shape)
        else:
            out.update({piece.key: piece.shape for piece in pieces})
    return out


def check_folder(pretrained: str, model: LayeredModel) -> dict[str, str]:
    """Before any rank starts: the folder's keys are exactly the model's and of its shapes.
    Returns the weight map. Errors are one line naming the key and what to change."""
    folder = folder_of(pretrained)
    files = weight_map(folder)
    names = names_of(model.config, files)
    want = expected_shapes(model, names)
    have = {k for k in files if not k.endswith(names.legacy) and not names.ignored(k)}
    if names.tied:
        have.discard("lm_head.weight")  # a tied head is the embedding, whatever the folder also holds
    where = f"model.pretrained={pretrained}"
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    layers = {c.rpartition("embed_tokens.")[0] for c in names.copies if c.endswith("embed_tokens.weight")}
    absent = sorted(layer for layer in layers if any(k.startswith(layer) for k in missing))
    if absent:  # DeepSeek's MTP layers (hf_deepseek.py): what transformers' save_pretrained leaves out
        raise ValueError(f"{where} has no MTP layer {absent[0]}* (it lacks {len(missing)} key(s) of model.mtp's "
                         f"depths): set model.mtp.depth=0, or use a folder with the release's MTP layer")
    if missing:
        raise ValueError(f"{where} lacks {missing[0]} ({len(missing)} key(s) missing): its safetensors do not "
                         f"match its config.json; re-save the folder with save_pretrained")
    if extra:
        raise ValueError(f"{where} holds {extra[0]} ({len(extra)} key(s) extra), not a weight of the model its "
                         f"config.json describes: fix config.json (e.g. tie_word_embeddings, the layer count) "
                         f"or re-save the folder")
    wrong, dtypes = [], {}  # (key, file, shape found); key -> dtype
    for name in sorted(set(files.values())):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{where}: {name} is listed in {INDEX} but is not in the folder")
        header = read_header(folder / name)
        dtypes.update({key: entry["dtype"] for key, entry in header.items()})
        wrong += [(key, name, entry["shape"]) for key, entry in header.items()
                  if key in want and tuple(entry["shape"]) != want[key]]
    hf_deepseek.check_scales(where, dtypes)
    if wrong:
        key, name, shape = min(wrong)
        raise ValueError(f"{where}: {key} in {name} has shape {list(shape)} but config.json's model needs "
                         f"{list(want[key])} ({len(wrong)} key(s) mis-shaped): the weights and config.json disagree")
    return files


class PretrainedWeights:
    """An init rule (models/init.py) giving each parameter its value from the folder's
    safetensors (`knobs`: the model's constructor arguments, see names_of). Opens a file the
    first time one of the asked keys lives in it; `opened` lists the files this process opened,
    in order, `read` the bytes it read per HF key (a test counts an EP rank's expert bytes)."""

    def __init__(self, pretrained: str, knobs: dict[str, Any]) -> None:
        self.folder = folder_of(pretrained)
        self.files = weight_map(self.folder)
        self.names = names_of(knobs, self.files)
        self.opened: list[str] = []
        self.read: dict[str, int] = {}
        self._handles: dict[str, Any] = {}

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        self._fill(name, tuple(value.shape), None, value)

    def init_block(self, name: str, shape: torch.Size, block: tuple[int, int, int], value: torch.Tensor,
                   generator: torch.Generator) -> None:
        """Fill `value` with rows [start, stop) of dimension `dim` (`block`) of the weight `name` of unsplit
        `shape` (models/init.py: materialize asks for an EP rank's experts): stacked experts read only
        those experts' bytes; any other weight is read whole and cut."""
        dim, start, stop = block
        if dim == 0 and self.names.pieces(name, tuple(shape)):
            self._fill(name, tuple(shape), (start, stop), value)
            return
        whole = torch.empty(shape, dtype=value.dtype)
        self._fill(name, tuple(shape), None, whole)
        value.copy_(whole.narrow(dim, start, stop - start))

    def _fill(self, name: str, shape: tuple[int, ...], experts: Optional[tuple[int, int]],
              value: torch.Tensor) -> None:
        """`value` := the weight `name` (unsplit `shape`), or only experts [start, stop) of it."""
        key = self.names.key(name)
        pieces = self.names.pieces(name, shape)
        if pieces == []:  # the aux_free bias of a family that stores none: unbiased routing
            value.zero_()
            return
        read = partial(self._read, name=name)
        tensor = self.names.layout(key, read(key, None)) if pieces is None else assemble(pieces, read, experts)
        if tuple(tensor.shape) != tuple(value.shape):
            raise ValueError(f"model.pretrained={self.folder}: {key} has shape {list(tensor.shape)} but the model "
                             f"needs {list(value.shape)}")
        value.copy_(tensor)  # cast to the fp32 the rule fills

    def _read(self, key: str, index: Optional[tuple[slice, ...]], *, name: str) -> torch.Tensor:
        """The tensor `key`, or its part `index` (safetensors' get_slice reads only those bytes)."""
        if key not in self.files:
            raise ValueError(f"model.pretrained={self.folder} lacks {key} (pipetrain's {name})")
        handle = self._open(self.files[key])
        if handle.get_slice(key).get_dtype() == hf_deepseek.FP8:  # DeepSeek-V3's release: 128x128 block scales
            scale = self._read(key + hf_deepseek.SCALE, None, name=name)
            tensor = hf_deepseek.dequantize(handle.get_tensor(key), scale)
            tensor = tensor if index is None else tensor[index]
        else:
            tensor = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.read[key] = self.read.get(key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
            self.opened.append(file)
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()


def pretrained_rule(model: ModelConfig) -> Optional[PretrainedWeights]:
    """The init rule of a model config with model.pretrained set (None: seeded initial weights)."""
    if model.pretrained is None:
        return None
    return PretrainedWeights(model.pretrained, model.knobs())


def gpt2_knobs(pretrained: str) -> dict[str, int]:
    """GPT-2's shape knobs from a GPT2LMHeadModel folder's config.json (GPT2ModelConfig.from_hf)."""
    path, raw = read_pretrained_config(pretrained)
    return GPT2ModelConfig.from_hf(raw, where=f"model.pretrained: {path}")


def hf_config(cfg: LlamaModelConfig | GPT2ModelConfig | DeepSeekModelConfig, *, dtype: str) -> dict[str, Any]:
    """config.json for `cfg`: the pretrained folder's own (shapes equal: it set them) or one
    written for the HF class computing the same maths: GPT2LMHeadModel (hf_gpt2.py), Qwen3
    (QK-norm), Qwen2 (q, k, v biases) or Llama (everything else, Mistral's shapes included: no
    sliding window)."""
    if cfg.pretrained is not None:
        out = read_json(folder_of(cfg.pretrained) / CONFIG)
        out["dtype" if "dtype" in out else "torch_dtype"] = HF_DTYPES[dtype]  # "dtype": transformers 5's spelling
        out.pop("quantization_config", None)  # an FP8 folder's: the export holds dequantized weights
        if isinstance(cfg, GPT2ModelConfig):  # export writes GPT2LMHeadModel's keys, from a GPT2Model folder too
            out["architectures"] = ["GPT2LMHeadModel"]
        return out
    if isinstance(cfg, GPT2ModelConfig):
        return hf_gpt2.hf_config(cfg, dtype=HF_DTYPES[dtype])
    if isinstance(cfg, DeepSeekModelConfig):
        return hf_deepseek.hf_config(cfg, dtype=HF_DTYPES[dtype])
    if cfg.qk_norm and (cfg.qkv_bias or cfg.attention_bias):
        raise ValueError("mode=export: no Hugging Face class has both QK-norm and attention biases: "
                         "set model.qk_norm=false or drop the biases")
    kind, arch = (("qwen3", "Qwen3ForCausalLM") if cfg.qk_norm else ("qwen2", "Qwen2ForCausalLM") if cfg.qkv_bias
                  else ("llama", "LlamaForCausalLM"))
    rope = None if cfg.rope_scaling is None else cfg.knobs()["rope_scaling"]
    out: dict[str, Any] = dict(
        architectures=[arch], model_type=kind, hidden_act="silu", initializer_range=0.02, use_cache=True,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=rope, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, attention_dropout=0.0, torch_dtype=HF_DTYPES[dtype],
    )
    if cfg.moe is not None:  # models/hf_moe.py: Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
        return {**out, **hf_moe_config(cfg.moe, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                                       qk_norm=cfg.qk_norm, qk_norm_per_head=cfg.qk_norm_per_head,
                                       qkv_bias=cfg.qkv_bias, attention_bias=cfg.attention_bias)}
    if kind == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    else:  # Qwen2 / Qwen3: full attention in every layer
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
        if kind == "qwen3":
            out.update(attention_bias=False)
    return out


def check_pretrained(cfg: ModelConfig) -> Optional[dict[str, str]]:
    """check_folder for a model config with model.pretrained set (the CLI calls it before
    launching); None when there is nothing to check."""
    if cfg.pretrained is None:
        return None
    with torch.device("meta"):
        kind = GPT2 if isinstance(cfg, GPT2ModelConfig) else DeepSeek if isinstance(cfg, DeepSeekModelConfig) else Llama
        model = kind(**cfg.knobs())
    return check_folder(cfg.pretrained, model)
