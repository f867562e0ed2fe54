"""The Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3) as an ordered list of pipeline layers.

Maths as Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM compute it
(our own code; tests/test_llama_hf.py compares logits with transformers within 1e-5):
  - pre-norm blocks, x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x));
    RMSNorm (Zhang & Sennrich 2019) computed in fp32, scaled by its weight;
  - attention with grouped-query heads (Ainslie et al. 2023, num_key_value_heads), an explicit
    head_dim (Qwen3: head_dim != hidden_size / heads), rotary position embeddings (Su et al.
    2021) in HF's half-split layout (rotate_half), optionally with Llama 3's frequency scaling
    (rope_scaling rope_type "llama3"); optional biases on q, k, v (`qkv_bias`, Qwen2) or on
    q, k, v and o (`attention_bias`, HF Llama's knob); optional QK-norm (Qwen3: RMSNorm over
    head_dim on q and k before RoPE; OLMoE: over all heads' q and k at once, qk_norm_per_head
    false); causal scaled_dot_product_attention, no dropout;
  - SwiGLU MLP (Shazeer 2020): down_proj(silu(gate_proj(x)) * up_proj(x)), no biases;
  - a final RMSNorm and an lm_head, tied to the token embedding or not (tie_word_embeddings);
  - with `moe` set, a Mixture-of-Experts MLP in the blocks model.moe picks (Mixtral, Qwen2/3-MoE,
    OLMoE: models/moe_block.py; their HF keys: models/hf_moe.py; sizes and costs: moe_costs.py).

Layers (causal_lm.py): 0 = embedding, 1..L = decoder blocks, L + 1 = head (norm + lm_head).
Parameter names are HF's shifted by the embedding's layer (`hf_name` / `pipetrain_name`):
`layers.{i+1}.self_attn.q_proj.weight` is HF's `model.layers.{i}.self_attn.q_proj.weight`,
`layers.0.embed_tokens.weight` is `model.embed_tokens.weight`, `layers.{L+1}.norm.weight`
is `model.norm.weight` and `layers.{L+1}.lm_head.weight` is `lm_head.weight`. Knobs are
named as HF's config.json (pipetrain.config.LlamaModelConfig checks them).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config.llama import LlamaModelConfig
from pipetrain.config.moe import MoEConfig
from pipetrain.config.mtp import MTPConfig
from pipetrain.models.causal_lm import IGNORE_INDEX, CausalLM
from pipetrain.models.moe_block import MoEBlock
from pipetrain.models.moe_nodes import block_nodes, single_node
from pipetrain.models.mtp import WithMTP, mtp_hf_key, mtp_name
from pipetrain.models.init import embedding
from pipetrain.parallel.layer_spec import Column, CrossEntropy, TPLayerPlan
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.stage_protocol import Node

INIT_STD = 0.02  # HF's initializer_range for every Llama-family config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # ones (Llama.init_parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the input dtype, cast back before the weight, as HF and Meta's reference.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) fp32 on CPU: theta^(-2i/d), and with rope_type
    "llama3" (Llama 3.1's long-context recipe) wavelengths longer than
    original_max_position_embeddings / low_freq_factor divided by `factor`, shorter than
    .../high_freq_factor kept, and a smooth interpolation between the two."""
    # device="cpu" even inside torch.device("meta"): a meta-built model's stages need real tables
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos and sin tables per (length, device, dtype), shared by a stage's blocks. A plain
    object, not a buffer: nothing to materialize on a meta-built model, nothing in checkpoints."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._cache: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, t: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (t, str(device), dtype)
        if key not in self._cache:
            pos = torch.arange(t, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq.to(device))  # (T, hd/2), fp32 as HF
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd): the half-split layout
            self._cache[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._cache[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hd) rotated pairwise (i, i + hd/2) by position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, h, T, hd/2)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(rotary: Rotary, cp: Optional[Any], docs: Optional[Documents], t: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for a block's T positions: (T, hd) by position in the row; under context parallel (`cp`,
    parallel/cp.py ContextAttention) at this rank's positions; with `docs` at each token's position in its
    document, (B, 1, T, hd) (under context parallel a document may be as long as the whole row)."""
    if docs is not None:
        n = t if cp is None else cp.seq_len
        return tuple(c[docs.positions].unsqueeze(1) for c in rotary.tables(n, device, dtype))  # type: ignore[return-value]
    return rotary.tables(t, device, dtype) if cp is None else cp.tables(rotary, device, dtype)


class Attention(nn.Module):
    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, attention_bias: bool,
                 qkv_bias: bool, qk_norm: bool, eps: float, rotary: Rotary, qk_norm_per_head: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary = heads, kv_heads, head_dim, rotary
        qkv = attention_bias or qkv_bias
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=attention_bias)
        # QK-norm per head over head_dim (Qwen3), or over all heads' q and k at once (OLMoE)
        self.norm_heads = qk_norm_per_head
        self.q_norm = RMSNorm(head_dim if qk_norm_per_head else heads * head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim if qk_norm_per_head else kv_heads * head_dim, eps) if qk_norm else None
        self.context: Optional[Any] = None  # context parallel (parallel/cp.py: ContextAttention), set by parallelize

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        """`docs` (document masks): block-causal attention, RoPE at each token's position in its document."""
        q, k = self.q_proj(x), self.k_proj(x)  # (B, T, H hd), (B, T, KV hd); sequence parallel: T/tp
        if self.q_norm is not None and self.k_norm is not None and not self.norm_heads:  # OLMoE
            q, k = self.q_norm(q), self.k_norm(k)
        b, t, _ = q.shape
        q = q.view(b, t, self.heads, self.head_dim)  # (B, T, H, hd); tensor parallel: this rank's H/tp heads
        k = k.view(b, t, self.kv_heads, self.head_dim)  # (B, T, KV, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if self.q_norm is not None and self.k_norm is not None and self.norm_heads:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        y = self.core(q, k, v, docs)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))  # (B, T, C)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        """Core attention (selective recompute's "attention"): RoPE on q (B, T, H, hd) and k (B, T, KV, hd),
        then attention with v (B, KV, T, hd) -> (B, H, T, hd)."""
        t, device = q.shape[1], q.device
        cp = self.context  # under context parallel x holds this rank's positions of each sequence only
        cos, sin = rope_tables(self.rotary, cp, docs, t, device, q.dtype)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, KV, T, hd)
        gqa = self.kv_heads != self.heads  # query head i reads key/value head i // (H / KV), as HF's repeat_kv
        if cp is not None:  # causal (or per document) by true position, K/V of the other positions from the cp group
            y = cp.attend(q, k, v, docs)
        elif docs is not None:  # block-causal: each query the keys of its own document up to itself
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask(), enable_gqa=gqa)
        else:  # without copying k and v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return y


class MLP(nn.Module):
    def __init__(self, *, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # (B, T, C) -> (B, T, I) -> (B, T, C)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation (selective recompute's "mlp_act"): (B, T, I) twice -> (B, T, I)."""
        return F.silu(gate) * up


def mlp_tp_plan(mlp: nn.Module) -> TPLayerPlan:
    """A decoder block's MLP part of its tensor-parallel plan (paths under `mlp.`): the dense SwiGLU MLP its own
    region (gate_proj, up_proj column-parallel, down_proj row-parallel); an MoE MLP (etp = tp) the router whole on
    every tp rank's tokens, each expert split in its width (`experts`), the shared experts as the dense MLP
    (gate_proj, up_proj both enter the region), their gate whole. Under sequence parallel (etp = 1) a tp rank
    routes its own positions: the router's and the shared experts' gate's gradients are summed over tp."""
    if not isinstance(mlp, MoEBlock):
        return TPLayerPlan(regions=("mlp",), column=(Column("mlp.gate_proj"), Column("mlp.up_proj")),
                           row=("mlp.down_proj",))
    partial_sp = ("mlp.router.weight",)
    if mlp.shared_experts is None:
        return TPLayerPlan(experts=("mlp.experts",), partial_sp=partial_sp)
    shared = "mlp.shared_experts"
    gate = (f"{shared}.gate.weight",) if mlp.shared_experts.gate is not None else ()
    return TPLayerPlan(column=(Column(f"{shared}.gate_proj"), Column(f"{shared}.up_proj")),
                       row=(f"{shared}.down_proj",), experts=("mlp.experts",), partial_sp=(*partial_sp, *gate))


class DecoderLayer(nn.Module):
    """`moe` set: the MLP is an MoE layer (models/moe_block.py) in place of the SwiGLU MLP; `attention`
    set: that module in place of grouped-query attention (models/deepseek.py: MLA)."""

    def __init__(self, *, hidden: int, intermediate: int, eps: float, moe: Optional[MoEConfig] = None,
                 attention: Optional[nn.Module] = None, **attn: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        # `attention`: another attention of the same contract (forward(x, docs), `context`): DeepSeek's MLA
        self.self_attn = Attention(hidden=hidden, eps=eps, **attn) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp: nn.Module = (MLP(hidden=hidden, intermediate=intermediate) if moe is None else
                               MoEBlock(moe, hidden=hidden, model_intermediate=intermediate))

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        x1, h = self.attend(x, docs)
        return x1 + self.mlp(h)

    def attend(self, x: torch.Tensor, docs: Optional[Documents] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) -> (x1, h): the residual stream after attention and its pre-MLP norm."""
        x1 = x + self.self_attn(self.input_layernorm(x), docs)
        return x1, self.post_attention_layernorm(x1)

    def documents_plan(self) -> tuple[str, ...]:
        """Document masks: attention block-causal per document, RoPE at positions within the document."""
        return ("mask", "positions")

    def nodes(self, key: str) -> list[Node]:
        """This block's forward as nodes for node-level execution (models/moe_nodes.py): an MoE block's
        attention, then its MoE's phases, then the residual; a dense block one node."""
        if not isinstance(self.mlp, MoEBlock):
            return single_node(self, key, docs=True)
        return block_nodes(self.mlp, key, attend=self.attend,
                           attend_modules=(self.input_layernorm, self.self_attn, self.post_attention_layernorm))

    def cp_plan(self) -> tuple[str, ...]:
        """What cp gives the cp group (parallel/cp.py): attention its K/V, an MoE MLP its balance loss's counts."""
        return ("self_attn", "mlp") if isinstance(self.mlp, MoEBlock) else ("self_attn",)

    def recompute_plan(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        """Selective recompute's calls (parallel/recompute.py): core attention, the norms, the dense MLP's
        activation, or the MoE's: its experts' (moe_act) and its shared experts' (mlp_act)."""
        norms = ["input_layernorm", "post_attention_layernorm"]
        attn = self.self_attn  # another attention (MLA) says its own norms: models/deepseek.py
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if isinstance(attn, Attention) and attn.q_norm else []
        plan = {"attention": (("self_attn", "core"),), "norm": tuple((n, "forward") for n in norms)}
        if isinstance(self.mlp, MLP):
            plan["mlp_act"] = (("mlp", "act"),)
        else:
            plan["moe_act"] = (("mlp.experts", "act"),)
            if self.mlp.shared_experts is not None:
                plan["mlp_act"] = (("mlp.shared_experts", "act"),)
        return plan

    def ep_plan(self) -> tuple[str, ...]:
        """The stacked experts expert parallel splits (parallel/ep.py): an MoE MLP's, none of a dense one."""
        return ("mlp.experts",) if isinstance(self.mlp, MoEBlock) else ()

    def tp_plan(self) -> TPLayerPlan:
        """Megatron's split: q, k, v, gate, up column-parallel, o and down row-parallel; a tp rank keeps
        H/tp query and KV/tp key/value heads (query head j still reads KV head j // (H/KV): tp divides KV); the
        MLP as mlp_tp_plan says."""
        attn = self.self_attn
        partial_sp = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        partial_sp += ["self_attn.o_proj.bias"] if attn.o_proj.bias is not None else []
        mlp = mlp_tp_plan(self.mlp)
        return TPLayerPlan(
            regions=("self_attn", *mlp.regions),
            column=(*(Column(p) for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), *mlp.column),
            row=("self_attn.o_proj", *mlp.row), experts=mlp.experts,
            head_counts=(("self_attn", "heads"), ("self_attn", "kv_heads")),
            partial=("self_attn.q_norm.weight", "self_attn.k_norm.weight") if attn.q_norm is not None else (),
            partial_sp=(*partial_sp, *mlp.partial_sp))


class Embedding(nn.Module):
    def __init__(self, *, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(vocab_size, hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)  # (B, T) -> (B, T, C); positions enter through RoPE

    def tp_plan(self) -> TPLayerPlan:
        return TPLayerPlan(vocab_embedding="embed_tokens")


class Head(nn.Module):
    def __init__(self, *, hidden: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, C) -> (B, T, V)

    def recompute_plan(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        return {"norm": (("norm", "forward"),)}

    def tp_plan(self) -> TPLayerPlan:
        """lm_head column-parallel on the vocabulary, its (B, T, V/tp) logits left split (the vocab-parallel loss)."""
        return TPLayerPlan(column=(Column("lm_head"),), partial_sp=("norm.weight",),
                           loss=CrossEntropy(IGNORE_INDEX))


class MTPHead(WithMTP, Head):
    """The head with multi-token prediction (model.mtp.depth > 0): its `mtp` depths run in the loss (models/mtp.py)."""


class Llama(CausalLM):
    """Knobs as LlamaModelConfig (HF config.json names); `seed` draws the initial weights."""

    family = "llama"

    def __init__(self, *, seed: int = 0, **knobs: Any) -> None:
        super().__init__()
        args = LlamaModelConfig(name="llama", **knobs)  # the schema's checks: one-line errors naming the knob
        self._config = cfg = args.resolved_knobs()
        c, v, n = args.hidden_size, args.vocab_size, args.num_hidden_layers
        self._set_shape(width=c, vocab=v, blocks=n, max_seq=args.max_position_embeddings, max_seq_knob=args.seq_knob)
        rotary = Rotary(args.head_size, args.rope_theta, cfg["rope_scaling"])
        self._args, self.rotary = args, rotary
        self.assemble([self.block(i) for i in range(n)], tie=args.tie_word_embeddings, eps=args.rms_norm_eps,
                      mtp=args.mtp, seed=seed)

    def block(self, index: int) -> DecoderLayer:
        """Decoder block `index`'s shape (dense or MoE MLP by model.moe), sharing the model's RoPE tables."""
        args = self._args
        moe = args.moe if args.moe is not None and args.moe.is_moe(index) else None
        return DecoderLayer(hidden=args.hidden_size, intermediate=args.intermediate_size, eps=args.rms_norm_eps,
                            heads=args.num_attention_heads, kv_heads=args.kv_heads, head_dim=args.head_size,
                            attention_bias=args.attention_bias, qkv_bias=args.qkv_bias, qk_norm=args.qk_norm,
                            qk_norm_per_head=args.qk_norm_per_head, rotary=self.rotary, moe=moe)

    def assemble(self, blocks: list[nn.Module], *, tie: bool, eps: float, mtp: MTPConfig, seed: int) -> None:
        """The pipeline layers: the embedding, `blocks`, the head (its lm_head the embedding's weight with
        `tie`; with `mtp.depth` MTP depths, each with a block like the last: models/mtp.py); then the initial
        weights drawn from `seed`."""
        c, v, n = self._width, self._vocab, len(blocks)
        embed = Embedding(vocab_size=v, hidden=c)
        head = (MTPHead if mtp.depth else Head)(hidden=c, vocab_size=v, eps=eps)
        if tie:
            head.lm_head.weight = embed.embed_tokens.weight  # one weight; split.py keeps cross-stage copies equal
        if isinstance(head, MTPHead):  # each depth's block of the last block's kind (models/mtp.py)
            head.attach(mtp, hidden=c, make_norm=lambda: RMSNorm(c, eps), embed=embed.embed_tokens,
                        make_block=lambda: self.block(n - 1), main_loss=type(self).loss_fn)
        self.layers = nn.ModuleList([embed, *blocks, head])
        self.layer_names = ["embed", *(f"layers.{i}" for i in range(n)), "head"]  # HF's block names
        self.reset_parameters(seed)

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        # HF's Llama init (N(0, initializer_range) for matmuls and the embedding, zero biases,
        # unit norms), with nanoGPT's depth scaling for the two projections that write into
        # the residual stream (o_proj, down_proj): std / sqrt(2 L), as gpt2.py does.
        # MoE blocks: experts as the MLP (w2 is down_proj), the router as a matmul, the aux_free bias at 0.
        if isinstance(self.get_submodule(name.rpartition(".")[0]), RMSNorm):
            nn.init.ones_(value)
        elif name.endswith((".bias", ".expert_bias")):
            nn.init.zeros_(value)
        else:
            residual = name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2"))
            std = INIT_STD / math.sqrt(2 * self._config["num_hidden_layers"]) if residual else INIT_STD
            nn.init.normal_(value, mean=0.0, std=std, generator=generator)


# ---- names: pipetrain <-> Hugging Face (pure) -----------------------------------------------


def hf_name(name: str, *, num_hidden_layers: int) -> str:
    """pipetrain's unsplit parameter name -> the HF (Llama/Mistral/Qwen2/Qwen3)ForCausalLM key."""
    head = num_hidden_layers + 1
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) > head:
        raise ValueError(f"{name!r} is not a parameter of a {num_hidden_layers}-block Llama model "
                         f"(names are layers.<0..{head}>.<rest>)")
    i, rest = int(parts[1]), parts[2]
    if i == head and rest.startswith(("lm_head.", "mtp.")):
        return rest if rest.startswith("lm_head.") else mtp_hf_key(rest, num_hidden_layers=num_hidden_layers)
    return f"model.{rest}" if i in (0, head) else f"model.layers.{i - 1}.{rest}"


def pipetrain_name(key: str, *, num_hidden_layers: int, mtp_depth: int = 0) -> str:
    """The HF key -> pipetrain's unsplit parameter name (the inverse of `hf_name`)."""
    head = num_hidden_layers + 1
    mtp = mtp_name(key, num_hidden_layers=num_hidden_layers, depth=mtp_depth)
    if mtp is not None:
        return f"layers.{head}.{mtp}"
    if key.startswith("lm_head."):
        return f"layers.{head}.{key}"
    if key.startswith(("model.embed_tokens.", "model.norm.")):
        return f"layers.{0 if key.startswith('model.embed_tokens.') else head}.{key[len('model.'):]}"
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
            and int(parts[2]) < num_hidden_layers:
        return f"layers.{int(parts[2]) + 1}.{parts[3]}"
    raise ValueError(f"{key!r} is not a key of a {num_hidden_layers}-layer HF Llama-family checkpoint")
