"""Tensor parallel applied to one stage after the cut and before FSDP2 (torchtitan's order:
pipeline split, then tensor parallel, then data parallel), from the plan each layer declares
(parallel/layer_spec.py: `tp_plan()`; GPT-2 and the Llama family have one). This module knows no
model class: it turns a plan's column / row / vocab-parallel paths into parallel/tp.py's layers.

  column-parallel   rows of the weight (and bias); the output stays split; a projection inside
                    a declared region does not enter the tp region again (one collective per region).
  row-parallel      columns of the weight, the bias whole.
  vocab-parallel    rows of the embedding table; under sequence parallel the layer's output is
                    then split on the sequence.
  head              column-parallel on the vocabulary, its logits left split; the last stage's
                    loss is the vocab-parallel cross-entropy (loss_parallel.py): no rank holds (B, T, V).
  experts           stacked MoE experts split in every expert's width (expert tensor parallel,
                    parallel.etp = tp: tp.py split_experts), or whole (etp = 1) with each tp rank
                    dispatching 1/tp of the tokens (tp.py split_tokens); the router stays whole.

Norms and position embeddings stay whole on every tp rank. Their gradients are equal across
the tp group, except where a rank sees only part of the work (the plan's `partial`, and under
sequence parallel its `partial_sp`): `TensorParallel` sums those over the tp group after each step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

from torch import nn

from pipetrain.parallel.layer_spec import TPLayerPlan, TPPlanned
from pipetrain.parallel.loss_parallel import vocab_parallel_cross_entropy
from pipetrain.parallel.mesh import RankGroups
from pipetrain.parallel.tp import (ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                   all_reduce_grads, enter_region, replace, shard_layout,
                                   split_experts, split_sequence, split_tokens)

if TYPE_CHECKING:
    from pipetrain.config import Config

Memo = dict[int, nn.Parameter]  # id(unsplit Parameter) -> its local slice (ties inside a stage stay one)


def apply_layer_plan(layer: nn.Module, plan: TPLayerPlan, g: TPGroup, memo: Memo) -> list[str]:
    """Parallelize one pipeline layer in place; returns its partial-gradient parameter names."""
    if plan.vocab_embedding is not None:
        emb = layer.get_submodule(plan.vocab_embedding)
        new = VocabParallelEmbedding(emb, g, weight=memo.get(id(emb.weight)))
        memo[id(emb.weight)] = new.weight
        replace(layer, plan.vocab_embedding, new)
        if g.sequence_parallel:  # the rest of the stage sees this rank's T/tp tokens
            layer.register_forward_hook(lambda _m, _i, out: split_sequence(out, g))
    for col in plan.column:
        lin = layer.get_submodule(col.path)
        inside = any(col.path.startswith(f"{r}.") for r in plan.regions)
        new = ColumnParallelLinear(lin, g, blocks=col.blocks, enter=not inside)
        if id(lin.weight) in memo:  # the head of a stage that also holds the tied embedding
            new.weight = memo[id(lin.weight)]
        memo[id(lin.weight)] = new.weight
        replace(layer, col.path, new)
    for region in plan.regions:
        enter_region(layer.get_submodule(region), g)
    for path in plan.row:
        replace(layer, path, RowParallelLinear(layer.get_submodule(path), g))
    for path, attr in plan.head_counts:
        module = layer.get_submodule(path)
        setattr(module, attr, getattr(module, attr) // g.size)
    return plan.partial_names(g.sequence_parallel)


def parallelize_stage(stage: nn.Module, g: TPGroup, *, split_width: bool = True) -> nn.Module:
    """Split a StageModule's layers over the tp group in place; `split_width`: stacked experts split in their
    width (parallel.etp = tp), else whole, each tp rank dispatching its share of the tokens (etp = 1). Sets
    `stage.tp_shards` (local name -> its `Split`: dimension, unsplit length, blocks) and `stage.tp_partial`
    (local names whose gradients the tp group sums after the step)."""
    memo: Memo = {}
    partial: list[str] = []
    plans = {}
    for key, layer in stage.layers.items():
        if not isinstance(layer, TPPlanned):
            raise ValueError(f"parallel.tp={g.size}: no tensor-parallel plan for {type(layer).__name__} "
                             f"(GPT-2, the Llama family and DeepSeek have one): set parallel.tp=1")
        plans[key] = layer.tp_plan()
        partial += [f"layers.{key}.{n}" for n in apply_layer_plan(layer, plans[key], g, memo)]
    stage.tp_shards = shard_layout(stage)
    for key, plan in plans.items():  # stacked experts split in their width (etp = tp), else tokens split (etp = 1)
        for path in plan.experts:
            if not split_width:
                split_tokens(stage.layers[key].get_submodule(path.rpartition(".")[0]), g)
                continue
            experts = split_experts(stage.layers[key].get_submodule(path), g)
            stage.tp_shards.update({f"layers.{key}.{path}.{n}": s for n, s in experts.items()})
    stage.tp_partial = tuple(partial)
    if stage.is_last:  # the last stage's loss reads its head's (B, T, V/tp) logits
        loss = plans[max(plans, key=int)].loss
        if loss is None:
            raise ValueError(f"{stage.loss_fn} has no vocab-parallel version: set parallel.tp=1")
        # equal to the causal LM's F.cross_entropy of the whole logits, which no tp rank then holds
        stage.set_loss(functools.partial(vocab_parallel_cross_entropy, g=g, ignore_index=loss.ignore_index))
    return stage


class TensorParallel:
    """How one rank's stages become tensor parallel: the plan per stage, the stage-to-stage
    shapes (sequence parallel: (B, T/tp, C)), the partial gradients summed after each step."""

    def __init__(self, g: TPGroup, *, split_experts: bool = True) -> None:
        self.g, self.split_experts = g, split_experts

    def wrap(self, stage: nn.Module) -> nn.Module:
        return parallelize_stage(stage, self.g, split_width=self.split_experts)

    def boundary_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A hidden (B, T, C) tensor crossing between stages, as this tp rank holds it."""
        if not self.g.sequence_parallel:
            return shape
        b, t, c = shape
        return (b, t // self.g.size, c)

    def reduce_partial(self, stages: dict[int, nn.Module]) -> None:
        """Sum over the tp group the gradients of whole weights each rank used on part of the work."""
        params = [p for s in sorted(stages) for n, p in stages[s].named_parameters()
                  if n in stages[s].tp_partial]
        all_reduce_grads(params, self.g)

    def sharded_names(self, stages: dict[int, nn.Module]) -> set[str]:
        """Canonical names (tie groups for tied weights) of the weights split across the tp group."""
        return {m.tied.get(n, n) for m in stages.values() for n in m.tp_shards}


def tensor_parallel(config: Config, groups: RankGroups) -> Optional[TensorParallel]:
    """None without tensor parallel (parallel.tp = 1)."""
    if groups.layout.tp == 1:
        return None
    return TensorParallel(TPGroup(groups.tp_group, groups.layout.tp, groups.tp_index,
                                  config.parallel.sequence_parallel), split_experts=groups.layout.etp > 1)
