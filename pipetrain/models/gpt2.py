"""GPT-2 (Radford et al. 2019) as an ordered list of pipeline layers.

Architecture as in OpenAI's release and nanoGPT's model.py (our own code, same maths):
learned position embeddings, pre-LayerNorm blocks (x + attn(ln_1(x)), x + mlp(ln_2(x))),
a 4x GELU MLP, causal self-attention, a final LayerNorm, and an output head whose weight
is the token embedding (weight tying), dropout after the embedding, in attention and on
both residual branches, biases in every Linear and LayerNorm except the head.

Two deliberate details:
  - GELU is GPT-2's tanh approximation (OpenAI's `gelu`, HF's `gelu_new`); nanoGPT uses the
    exact erf GELU, which differs by < 1e-3 and would not be "GPT-2 exactly".
  - vocab_size stays 50257 (nanoGPT pads to 50304 for speed) so parameter counts are the
    published ones: 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200, the sizes
    OpenAI named its checkpoints by (124M, 355M, 774M, 1558M).

Layers (causal_lm.py): 0 = Embedding (idx (B, T) int64 -> (B, T, C)), 1..n_layer = Block
((B, T, C) -> (B, T, C)), n_layer + 1 = Head ((B, T, C) -> logits (B, T, V)).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.causal_lm import IGNORE_INDEX, CausalLM
from pipetrain.models.init import embedding
from pipetrain.parallel.layer_spec import Column, CrossEntropy, TPLayerPlan
from pipetrain.runtime.documents import Documents

# Knob values per preset; every preset uses dropout 0.0 and bias True unless overridden.
# gpt2-tiny: 8 blocks (enough for 8 stages), width 128, and a 512-token (byte-level-sized)
# vocabulary and 256-token context so a CPU step takes milliseconds, not seconds.
PRESETS: dict[str, dict[str, int]] = {
    "gpt2-tiny": dict(n_layer=8, n_head=4, n_embd=128, vocab_size=512, block_size=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
}

INIT_STD = 0.02  # GPT-2's initializer_range


class Embedding(nn.Module):
    """Token + learned position embedding, then dropout."""

    def __init__(self, *, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = embedding(vocab_size, n_embd)
        self.wpe = embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        _, t = idx.shape  # (B, T) int64
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}: shorten the sequences")
        # (T,), or with document masks each token's position in its document (B, T)
        pos = torch.arange(t, dtype=torch.long, device=idx.device) if docs is None else docs.positions
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) or (B, T, C) -> (B, T, C)

    def documents_plan(self) -> tuple[str, ...]:
        return ("positions",)  # positions restart per document

    def tp_plan(self) -> TPLayerPlan:
        return TPLayerPlan(vocab_embedding="wte")  # wpe stays whole: it is added after the all-reduce


class CausalSelfAttention(nn.Module):
    def __init__(self, *, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3C); tensor parallel: (B, T, 3C/tp), this rank's heads of q, k, v
        b, t, _ = qkv.shape  # T from the projection: sequence parallel hands x in as (B, T/tp, C)
        q, k, v = qkv.chunk(3, dim=2)  # 3 x (B, T, C)
        c = q.size(-1)  # C (tensor parallel: C/tp, n_head = this rank's heads)
        hs = c // self.n_head
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # Fused attention (flash / memory-efficient where available); is_causal applies the
        # lower-triangular mask, so no (T, T) mask buffer is stored. Document masks: block-causal
        # per document, the (B, 1, T, T) mask built once per stage forward (runtime/documents.py).
        p = self.dropout if self.training else 0.0
        if docs is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask(), dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, nh, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, *, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's own GELU (see module docstring)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2 moved the norms to each sub-block's input)."""

    def __init__(self, *, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd=n_embd, n_head=n_head, dropout=dropout, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd=n_embd, dropout=dropout, bias=bias)

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), docs)
        return x + self.mlp(self.ln_2(x))

    def documents_plan(self) -> tuple[str, ...]:
        return ("mask",)  # attention block-causal per document

    def tp_plan(self) -> TPLayerPlan:
        """c_attn column-parallel per head (rank r holds rows r of q, of k and of v), c_fc column-parallel,
        both c_proj row-parallel; under SP the norms and the row-parallel biases see a rank's tokens only."""
        biases = tuple(f"{p}.bias" for p in ("attn.c_proj", "mlp.c_proj") if self.get_submodule(p).bias is not None)
        return TPLayerPlan(column=(Column("attn.c_attn", blocks=3), Column("mlp.c_fc")),
                           row=("attn.c_proj", "mlp.c_proj"), head_counts=(("attn", "n_head"),),
                           partial_sp=_norm_names(self) + biases)


class Head(nn.Module):
    """Final LayerNorm and the output projection; `lm_head.weight` is tied to `wte.weight`."""

    def __init__(self, *, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, V)

    def tp_plan(self) -> TPLayerPlan:
        return TPLayerPlan(column=(Column("lm_head"),), partial_sp=_norm_names(self),  # (B, T, V/tp) logits
                           loss=CrossEntropy(IGNORE_INDEX))


def _norm_names(layer: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, _ in layer.named_parameters() if n.startswith("ln_"))


class GPT2(CausalLM):
    family = "gpt2"

    def __init__(
        self,
        *,
        n_layer: int,
        n_head: int,
        n_embd: int,
        vocab_size: int,
        block_size: int,
        dropout: float = 0.0,  # 0 for pretraining (nanoGPT); GPT-2 itself trained with 0.1
        bias: bool = True,  # GPT-2 has biases in Linears and LayerNorms
        seed: int = 0,  # initial weights (init.py); nothing is drawn on the meta device
    ) -> None:
        super().__init__()
        _check_config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                      block_size=block_size, dropout=dropout)
        self._config = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                            block_size=block_size, dropout=dropout, bias=bias)
        self._set_shape(width=n_embd, vocab=vocab_size, blocks=n_layer, max_seq=block_size,
                        max_seq_knob="block_size")
        embed = Embedding(vocab_size=vocab_size, block_size=block_size, n_embd=n_embd, dropout=dropout)
        blocks = [Block(n_embd=n_embd, n_head=n_head, dropout=dropout, bias=bias) for _ in range(n_layer)]
        head = Head(n_embd=n_embd, vocab_size=vocab_size, bias=bias)
        head.lm_head.weight = embed.wte.weight  # weight tying (Press & Wolf 2017), as GPT-2
        self.layers = nn.ModuleList([embed, *blocks, head])
        self.layer_names = ["embed", *(f"h.{i}" for i in range(n_layer)), "head"]
        self.reset_parameters(seed)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPT2:
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}: choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        # GPT-2 / nanoGPT init: N(0, 0.02) for every matmul and embedding weight, zero biases,
        # LayerNorm (1, 0); the projections that write into the residual stream (c_proj) get
        # std 0.02 / sqrt(2 * n_layer) so the residual's variance does not grow with depth
        # (two residual additions per block).
        module = self.get_submodule(name.rpartition(".")[0])
        if name.endswith(".bias"):
            nn.init.zeros_(value)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(value)
        else:
            proj = name.endswith("c_proj.weight")
            std = INIT_STD / math.sqrt(2 * self._config["n_layer"]) if proj else INIT_STD
            nn.init.normal_(value, mean=0.0, std=std, generator=generator)



def _check_config(*, n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int,
                  dropout: float) -> None:
    for knob, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                        ("vocab_size", vocab_size), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"model.{knob} must be >= 1 (got {value})")
    if n_embd % n_head:
        raise ValueError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1) (got {dropout})")
