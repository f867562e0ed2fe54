"""GPT-2 as a Hugging Face `GPT2LMHeadModel` folder: key names, the Conv1D layout, config.json.

models/hf.py reads and writes the files; this module says what GPT-2's are called there.
Keys: pipetrain's layers.0 (wte, wpe) -> transformer.wte / transformer.wpe, layers.1..n (blocks)
-> transformer.h.0..n-1, layers.n+1 (ln_f, lm_head) -> transformer.ln_f and lm_head. A
`GPT2Model` folder (how the hub's own openai-community/gpt2 is saved) has the same keys without
the "transformer." prefix, and older ones also hold each block's causal-mask buffers
(h.N.attn.bias, h.N.attn.masked_bias): derived, not weights. The head is always the embedding
(GPT-2 ties them), so lm_head.weight is never read and never written, as save_pretrained does.

HF's GPT-2 computes its four matmuls with `Conv1D`, whose weight is (in, out): the transpose of
nn.Linear's (out, in) that pipetrain's blocks use, so those four are transposed both ways.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pipetrain.config.models import GPT2_LAYER_NORM_EPS, GPT2ModelConfig

PREFIX = "transformer."  # GPT2LMHeadModel's; a GPT2Model folder has none
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
LEGACY_KEYS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older transformers saved
TIED_KEY = "lm_head.weight"


def prefix_of(keys: Any) -> str:
    """The prefix a folder's keys carry: "transformer." (GPT2LMHeadModel) or "" (GPT2Model)."""
    return PREFIX if any(k.startswith(PREFIX) for k in keys) else ""


def hf_key(name: str, *, n_layer: int, prefix: str = PREFIX) -> str:
    """pipetrain's unsplit GPT-2 parameter name -> the HF key (`prefix`: see prefix_of)."""
    head = n_layer + 1
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)  # layers.<pipeline layer>.<name inside it>
    if m is None or int(m.group(1)) > head:
        raise ValueError(f"{name!r} is not a parameter of a {n_layer}-block GPT-2 model "
                         f"(names are layers.<0..{head}>.<rest>)")
    i, rest = int(m.group(1)), m.group(2)
    if i == head and rest == TIED_KEY:
        return TIED_KEY
    return f"{prefix}{rest}" if i in (0, head) else f"{prefix}h.{i - 1}.{rest}"


def swap_layout(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in HF's layout from pipetrain's, or back (a transpose: its own inverse)."""
    return tensor.t() if key.endswith(CONV1D) else tensor


def hf_config(cfg: GPT2ModelConfig, *, dtype: str) -> dict[str, Any]:
    """config.json of a GPT2LMHeadModel computing what `cfg` computes (`dtype`: HF's spelling)."""
    if not cfg.bias:
        raise ValueError("mode=export: GPT2LMHeadModel has biases in every Linear and LayerNorm, model.bias=false "
                         "has none: export a model trained with model.bias=true")
    endoftext = 50256 if cfg.vocab_size == 50257 else None  # GPT-2's <|endoftext|>, in its own vocabulary only
    return dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size, n_positions=cfg.block_size,
        n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=None, activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, layer_norm_epsilon=GPT2_LAYER_NORM_EPS,
        initializer_range=0.02, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False, tie_word_embeddings=True, use_cache=True, bos_token_id=endoftext,
        eos_token_id=endoftext, torch_dtype=dtype,
    )
