"""How a model family's pipeline layer splits over a tensor-parallel group, declared as data.

Each layer class of a family that supports tensor parallel has a `tp_plan()` method returning a
`TPLayerPlan`: which of its sub-modules are column-parallel, row-parallel or a vocab-parallel
embedding, which attributes count heads (divided by tp), and which whole weights see only part of
the work (their gradients are summed over the tp group after each step). `parallel/tp_plan.py`
applies any such plan without knowing the model classes: the models import this vocabulary
(downward), parallel/ imports nothing of models/ (torchtitan keeps each model's `parallelize_fn`
beside the model the same way). This file imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Column:
    """A column-parallel Linear at `path`; `blocks` equal consecutive blocks of its output are cut
    alike (GPT-2's fused c_attn: 3, so a tp rank holds q, k and v of the same heads)."""

    path: str
    blocks: int = 1


@dataclass(frozen=True)
class CrossEntropy:
    """The head's logits feed the causal LM's mean cross-entropy, targets equal to `ignore_index`
    counting in none: under tensor parallel the vocab-parallel version replaces it (loss_parallel.py)."""

    ignore_index: int


@dataclass(frozen=True)
class TPLayerPlan:
    # modules whose input enters the tp region once for all their column-parallel projections
    # (Llama's q, k, v and gate, up: one all-reduce, under SP one all-gather, each)
    regions: tuple[str, ...] = ()
    column: tuple[Column, ...] = ()  # outside a region a projection enters the region itself
    row: tuple[str, ...] = ()  # partial products summed (SP: reduce-scattered on the sequence)
    vocab_embedding: str | None = None  # rows of the table; under SP the layer's output is then split
    head_counts: tuple[tuple[str, str], ...] = ()  # (module path, attribute): heads a tp rank keeps, / tp
    partial: tuple[str, ...] = ()  # whole weights that see this rank's heads only (Qwen3's q/k norms)
    partial_sp: tuple[str, ...] = ()  # whole weights that see this rank's tokens only under SP
    loss: CrossEntropy | None = None  # a head whose split logits the loss reads

    def partial_names(self, sequence_parallel: bool) -> list[str]:
        return [*self.partial, *(self.partial_sp if sequence_parallel else ())]


@runtime_checkable
class TPPlanned(Protocol):
    """A layer that declares its tensor-parallel plan."""

    def tp_plan(self) -> TPLayerPlan: ...
