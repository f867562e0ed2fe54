"""The tensor-parallel plans of GPT-2 and the Llama family, applied to one stage after the cut
and before FSDP2 (torchtitan's order: pipeline split, then tensor parallel, then data parallel).

  Llama block   q_proj, k_proj, v_proj, gate_proj, up_proj column-parallel; o_proj, down_proj
                row-parallel; this rank's H/tp query and KV/tp key/value heads (query head j
                still reads KV head j // (H/KV): tp divides KV).
  GPT-2 block   c_attn column-parallel split per head: rank r holds rows r of q, of k and of v
                (`Split(0, 3C, blocks=3)`), not the first 3C/tp rows of the fused matrix;
                c_fc column-parallel; both c_proj row-parallel.
  embedding     vocab-parallel (GPT-2's wpe stays whole: it is added after the all-reduce).
  head          lm_head column-parallel on the vocabulary, its logits left split; the last stage's
                loss is the vocab-parallel cross-entropy (loss_parallel.py): no rank holds (B, T, V).

Norms and position embeddings stay whole on every tp rank. Their gradients are equal across
the tp group, except where a rank sees only part of the work: under sequence parallel the
norms and the row-parallel biases (their tokens only), and Qwen3's per-head q/k norms (their
heads only); `TensorParallel` lists those (`partial`) and sums them over the tp group after
each step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

from pipetrain.models import gpt2, llama
from pipetrain.models.causal_lm import IGNORE_INDEX, CausalLM
from pipetrain.parallel.loss_parallel import vocab_parallel_cross_entropy
from pipetrain.parallel.mesh import RankGroups
from pipetrain.parallel.tp import (ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                   all_reduce_grads, enter_region, replace, shard_layout,
                                   split_sequence)

if TYPE_CHECKING:
    from pipetrain.config import Config

Memo = dict[int, nn.Parameter]  # id(unsplit Parameter) -> its local slice (ties inside a stage stay one)


def _column(layer: nn.Module, path: str, g: TPGroup, *, blocks: int = 1, memo: Memo, enter: bool = True) -> None:
    lin = layer.get_submodule(path)
    new = ColumnParallelLinear(lin, g, blocks=blocks, enter=enter)
    if id(lin.weight) in memo:  # the head of a stage that also holds the tied embedding
        new.weight = memo[id(lin.weight)]
    memo[id(lin.weight)] = new.weight
    replace(layer, path, new)


def _row(layer: nn.Module, path: str, g: TPGroup) -> None:
    lin = layer.get_submodule(path)
    replace(layer, path, RowParallelLinear(lin, g))


def _embedding(layer: nn.Module, path: str, g: TPGroup, memo: Memo) -> None:
    emb = layer.get_submodule(path)
    new = VocabParallelEmbedding(emb, g, weight=memo.get(id(emb.weight)))
    memo[id(emb.weight)] = new.weight
    replace(layer, path, new)
    if g.sequence_parallel:  # the rest of the stage sees this rank's T/tp tokens
        layer.register_forward_hook(lambda _m, _i, out: split_sequence(out, g))


def _llama(layer: nn.Module, g: TPGroup, memo: Memo) -> list[str]:
    """Parallelize one Llama pipeline layer in place; returns its partial-gradient parameter names."""
    sp = g.sequence_parallel
    if isinstance(layer, llama.Embedding):
        _embedding(layer, "embed_tokens", g, memo)
        return []
    if isinstance(layer, llama.Head):
        _column(layer, "lm_head", g, memo=memo)  # (B, T, V/tp) logits
        return ["norm.weight"] if sp else []
    assert isinstance(layer, llama.DecoderLayer), type(layer)
    for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        _column(layer, path, g, memo=memo, enter=False)
    enter_region(layer.self_attn, g)  # one all-reduce (SP: all-gather) for q, k, v; one for gate, up
    enter_region(layer.mlp, g)
    for path in ("self_attn.o_proj", "mlp.down_proj"):
        _row(layer, path, g)
    attn = layer.self_attn
    attn.heads, attn.kv_heads = attn.heads // g.size, attn.kv_heads // g.size
    partial = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if attn.q_norm is not None else []
    if sp:
        partial += ["input_layernorm.weight", "post_attention_layernorm.weight"]
        partial += ["self_attn.o_proj.bias"] if attn.o_proj.bias is not None else []
    return partial


def _gpt2(layer: nn.Module, g: TPGroup, memo: Memo) -> list[str]:
    """Parallelize one GPT-2 pipeline layer in place; returns its partial-gradient parameter names."""
    if isinstance(layer, gpt2.Embedding):
        _embedding(layer, "wte", g, memo)
        return []
    norms = [n for n, _ in layer.named_parameters() if n.startswith(("ln_", "ln_f"))]
    if isinstance(layer, gpt2.Head):
        _column(layer, "lm_head", g, memo=memo)  # (B, T, V/tp) logits
        return norms if g.sequence_parallel else []
    assert isinstance(layer, gpt2.Block), type(layer)
    _column(layer, "attn.c_attn", g, blocks=3, memo=memo)  # q, k, v of this rank's heads
    _column(layer, "mlp.c_fc", g, memo=memo)
    _row(layer, "attn.c_proj", g)
    _row(layer, "mlp.c_proj", g)
    layer.attn.n_head //= g.size
    biases = [f"{p}.bias" for p in ("attn.c_proj", "mlp.c_proj") if layer.get_submodule(p).bias is not None]
    return norms + biases if g.sequence_parallel else []


PLANS: dict[type, Callable[[nn.Module, TPGroup, Memo], list[str]]] = {
    llama.Embedding: _llama, llama.DecoderLayer: _llama, llama.Head: _llama,
    gpt2.Embedding: _gpt2, gpt2.Block: _gpt2, gpt2.Head: _gpt2,
}


def parallelize_stage(stage: nn.Module, g: TPGroup) -> nn.Module:
    """Split a StageModule's layers over the tp group in place. Sets `stage.tp_shards`
    (local name -> its `Split`: dimension, unsplit length, blocks) and `stage.tp_partial` (local names
    whose gradients the tp group sums after the step)."""
    memo: Memo = {}
    partial: list[str] = []
    for key, layer in stage.layers.items():
        plan = PLANS.get(type(layer))
        if plan is None:
            raise ValueError(f"parallel.tp={g.size}: no tensor-parallel plan for {type(layer).__name__} "
                             f"(GPT-2 and the Llama family have one): set parallel.tp=1")
        partial += [f"layers.{key}.{n}" for n in plan(layer, g, memo)]
    stage.tp_shards = shard_layout(stage)
    stage.tp_partial = partial
    if stage.is_last:
        _loss_parallel(stage, g)
    return stage


def _loss_parallel(stage: nn.Module, g: TPGroup) -> None:
    """The last stage's loss on its head's (B, T, V/tp) logits: the vocab-parallel cross-entropy,
    equal to the causal LM's F.cross_entropy of the whole logits, which no tp rank then holds."""
    if stage.loss_fn is not CausalLM.loss_fn:
        raise ValueError(f"{stage.loss_fn} has no vocab-parallel version: set parallel.tp=1")
    stage.set_loss(functools.partial(vocab_parallel_cross_entropy, g=g, ignore_index=IGNORE_INDEX))


class TensorParallel:
    """How one rank's stages become tensor parallel: the plan per stage, the stage-to-stage
    shapes (sequence parallel: (B, T/tp, C)), the partial gradients summed after each step."""

    def __init__(self, g: TPGroup) -> None:
        self.g = g

    def wrap(self, stage: nn.Module) -> nn.Module:
        return parallelize_stage(stage, self.g)

    def boundary_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A hidden (B, T, C) tensor crossing between stages, as this tp rank holds it."""
        if not self.g.sequence_parallel:
            return shape
        b, t, c = shape
        return (b, t // self.g.size, c)

    def reduce_partial(self, stages: dict[int, nn.Module]) -> None:
        """Sum over the tp group the gradients of whole weights each rank used on part of the work."""
        params = [p for s in sorted(stages) for n, p in stages[s].named_parameters()
                  if n in getattr(stages[s], "tp_partial", ())]
        all_reduce_grads(params, self.g)

    def sharded_names(self, stages: dict[int, nn.Module]) -> set[str]:
        """Canonical names (tie groups for tied weights) of the weights split across the tp group."""
        return {getattr(m, "tied", {}).get(n, n) for m in stages.values() for n in getattr(m, "tp_shards", {})}


def tensor_parallel(config: Config, groups: RankGroups) -> Optional[TensorParallel]:
    """None without tensor parallel (parallel.tp = 1)."""
    if groups.layout.tp == 1:
        return None
    return TensorParallel(TPGroup(groups.tp_group, groups.layout.tp, groups.tp_index,
                                  config.parallel.sequence_parallel))
