"""Hugging Face keys of MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in both on-disk layouts.

pipetrain stacks a block's experts (models/moe.py: `experts.w1`, `w3` (E, I, H), `w2` (E, H, I)),
so one of its weights is several HF tensors, or a part of one:

  per_expert  the hub's originals and what transformers' save_pretrained writes: one 2-D tensor
              per expert, `...experts.{j}.gate_proj|up_proj|down_proj.weight` (Mixtral:
              `block_sparse_moe.experts.{j}.w1|w3|w2.weight`), stacked along dim 0 here;
  fused       transformers 5's in-memory layout, which some re-saved checkpoints keep:
              `mlp.experts.gate_up_proj` (E, 2I, H) = cat([w1, w3], 1) and `mlp.experts.down_proj` = w2.

The layout (and Mixtral's `block_sparse_moe.` prefix) is read off the folder's keys; mode=export
writes either (export.moe_layout). Under expert parallel a rank reads only its experts' bytes
(`assemble` with `experts`): their per-expert keys, or a dim-0 slice of the fused tensors. The router is
`mlp.gate.weight` (Mixtral per-expert: `block_sparse_moe.gate.weight`); Qwen2-MoE's shared expert
`mlp.shared_expert.*` with `mlp.shared_expert_gate.weight`. The aux_free `router.expert_bias` has
no key in these families: it starts at 0 (`pieces` gives no key for it); DeepSeek-V3's is
`mlp.gate.e_score_correction_bias`, its shared experts `mlp.shared_experts.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from pipetrain.config.moe import MoEConfig

FUSED_SUFFIX = ".experts.gate_up_proj"
MIXTRAL_BLOCK = ".block_sparse_moe."
PER_EXPERT = {False: {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},  # Qwen / OLMoE names
              True: {"w1": "w1", "w3": "w3", "w2": "w2"}}  # Mixtral's
SHARED = {"shared_experts.gate_proj.weight": "shared_expert.gate_proj.weight",
          "shared_experts.up_proj.weight": "shared_expert.up_proj.weight",
          "shared_experts.down_proj.weight": "shared_expert.down_proj.weight",
          "shared_experts.gate.weight": "shared_expert_gate.weight"}


@dataclass(frozen=True)
class Piece:
    """One HF tensor (its key and on-disk shape) and the part of it a pipetrain weight takes:
    expert `expert`'s 2-D tensor (the per-expert layout), rows [start, stop) of dim 1 (`part`: a
    fused gate_up_proj's half), or all of it."""

    key: str
    shape: tuple[int, ...]
    part: Optional[tuple[int, int]] = None
    expert: Optional[int] = None


@dataclass(frozen=True)
class MoEKeys:
    """How one folder stores MoE blocks: `fused` experts or per expert, Mixtral's names or not; DeepSeek's
    (`deepseek`: `mlp.shared_experts.*` as pipetrain names them, and with `bias` the aux-free bias as
    `mlp.gate.e_score_correction_bias`, DeepSeek-V3's; V2 has none)."""

    fused: bool = False
    mixtral: bool = False
    deepseek: bool = False
    bias: bool = False

    @classmethod
    def of(cls, keys: Iterable[str]) -> MoEKeys:
        keys = list(keys)
        return cls(fused=any(k.endswith(FUSED_SUFFIX) for k in keys), mixtral=any(MIXTRAL_BLOCK in k for k in keys))

    def pieces(self, block_key: str, rest: str, shape: tuple[int, ...]) -> Optional[list[Piece]]:
        """The HF tensors making pipetrain's `mlp.<rest>` of the block whose HF prefix is `block_key`
        (`model.layers.{i}`), `shape` its stacked shape; None: not an MoE weight ([]: none on disk)."""
        mlp = f"{block_key}.block_sparse_moe" if self.mixtral and not self.fused else f"{block_key}.mlp"
        if rest == "router.weight":
            return [Piece(f"{mlp}.gate.weight", shape)]
        if rest == "router.expert_bias":
            return [Piece(f"{mlp}.gate.e_score_correction_bias", shape)] if self.bias else []
        if self.deepseek and rest.startswith("shared_experts."):
            return [Piece(f"{mlp}.{rest}", shape)]
        if rest in SHARED:
            return [Piece(f"{mlp}.{SHARED[rest]}", shape)]
        if rest not in ("experts.w1", "experts.w3", "experts.w2"):
            return None
        which = rest.rpartition(".")[2]
        e, rows, cols = shape
        if self.fused:
            if which == "w2":
                return [Piece(f"{mlp}.experts.down_proj", shape)]
            part = (0, rows) if which == "w1" else (rows, 2 * rows)
            return [Piece(f"{mlp}{FUSED_SUFFIX}", (e, 2 * rows, cols), part)]
        name = PER_EXPERT[self.mixtral][which]
        return [Piece(f"{mlp}.experts.{j}.{name}.weight", (rows, cols), expert=j) for j in range(e)]


Read = Callable[[str, Optional[tuple[slice, ...]]], torch.Tensor]  # (HF key, index or None: all) -> tensor


def assemble(pieces: list[Piece], read: Read, experts: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The pipetrain weight from its pieces: one tensor (or its dim-1 part), or per-expert ones stacked.
    `experts` = (start, stop): only those rows of dim 0 (an EP rank's experts), reading nothing else:
    per expert only their keys, fused a slice (safetensors reads just its bytes)."""
    first = slice(None) if experts is None else slice(*experts)
    if pieces and pieces[0].expert is not None:
        return torch.stack([read(p.key, None) for p in pieces[first]])
    (piece,) = pieces
    if piece.part is None and experts is None:
        return read(piece.key, None)
    return read(piece.key, (first, slice(None) if piece.part is None else slice(*piece.part)))


def to_hf(tensors: dict[str, tuple[list[Piece], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Export: pipetrain's weights (name -> its pieces and value) as HF tensors: per expert one per row,
    whole ones as they are, a fused gate_up_proj from its two halves (w1 and w3, which must be given
    together). A nonzero aux_free bias has no HF key and would change the routing: refused in one line."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, (pieces, tensor) in tensors.items():
        if not pieces and bool(tensor.abs().sum() > 0):
            raise ValueError(f"mode=export: {name} is nonzero (balance=aux_free moved it) but the Hugging Face "
                             f"class has no such weight, so its routing would differ: export a model trained with "
                             f"model.moe.balance=aux_loss|seq_aux_loss|none")
        for j, p in enumerate(pieces):
            if p.part is not None:
                halves.setdefault(p.key, []).append((p.part[0], tensor))
            else:
                out[p.key] = tensor if p.expert is None else tensor[j]
    for key, parts in halves.items():  # gate_up_proj (E, 2I, H) = cat([w1, w3], 1)
        assert len(parts) == 2, f"{key}: export got {len(parts)} of its 2 halves (w1, w3) in one shard"
        out[key] = torch.cat([t for _, t in sorted(parts, key=lambda part: part[0])], 1)
    return out


def hf_moe_config(moe: MoEConfig, *, intermediate: int, layers: int, qk_norm: bool, qk_norm_per_head: bool,
                  qkv_bias: bool, attention_bias: bool) -> dict[str, Any]:
    """config.json fields (model_type first) of the HF MoE class computing pipetrain's blocks:
    OLMoE (QK-norm over all heads), Qwen2-MoE (a gated shared expert), Qwen3-MoE (QK-norm per
    head) or Mixtral (plain attention, every block MoE); anything else is a one-line ValueError."""
    dense = [i for i in range(layers) if not moe.is_moe(i)]
    width = moe.expert_width(intermediate)
    biases = attention_bias or (qkv_bias and not moe.num_shared_experts)  # only Qwen2-MoE has q, k, v biases
    why = ("model.moe.score_func=sigmoid" if moe.score_func != "softmax" else
           "model.moe.n_group > 1" if moe.n_group > 1 else
           "model.moe.routed_scaling_factor != 1" if moe.routed_scaling_factor != 1.0 else
           "attention biases with an MoE model" if biases else None)
    common = dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
                  router_aux_loss_coef=0.0, output_router_logits=False)
    if why is None and qk_norm and not qk_norm_per_head and not dense and not moe.num_shared_experts and not qkv_bias:
        return dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], **common, intermediate_size=width,
                    clip_qkv=None, attention_bias=False)
    qwen = dict(**common, moe_intermediate_size=width, intermediate_size=intermediate, decoder_sparse_step=1,
                mlp_only_layers=dense, use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if why is None and moe.num_shared_experts == 1 and moe.shared_gate and not qk_norm:
        return dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], **qwen, qkv_bias=qkv_bias,
                    shared_expert_intermediate_size=moe.shared_width(intermediate))
    if why is None and qk_norm and qk_norm_per_head and not moe.num_shared_experts:
        return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **qwen, attention_bias=False)
    if why is None and not qk_norm and not moe.num_shared_experts and not dense and moe.norm_topk_prob:
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=moe.num_experts,
                    num_experts_per_tok=moe.top_k, intermediate_size=width, sliding_window=None,
                    router_aux_loss_coef=0.0, router_jitter_noise=0.0, output_router_logits=False)
    why = why or "its mix of QK-norm, shared experts and dense blocks"
    raise ValueError(f"mode=export: no Hugging Face MoE class computes this model ({why}): Mixtral, Qwen2-MoE, "
                     f"Qwen3-MoE and OLMoE shapes export")
