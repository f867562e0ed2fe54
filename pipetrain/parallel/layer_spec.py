"""The layer contract: what a pipeline layer offers to tensor, expert and context parallel and to
node-level execution, declared as data and methods the layer has, read with isinstance (never getattr).

  tp_plan() -> TPLayerPlan   tensor parallel: which sub-modules are column-parallel, row-parallel or a
                             vocab-parallel embedding, which attributes count heads (divided by tp), which
                             whole weights see part of the work (summed over tp after each step); applied
                             by parallel/tp_plan.py
  ep_plan() -> paths         expert parallel: the stacked-experts modules ((E, ...) weights; their forward
                             takes rows sorted by expert and counts), split by parallel/ep.py
  cp_plan() -> paths         context parallel: the modules that reach across positions (parallel/cp.py):
                             attention (the cp group's K/V), an MoE MLP (its balance loss's counts)
  documents_plan() -> reads  document masks (runtime/documents.py): the layer's forward takes the microbatch's
                             Documents as a second argument, `layer(x, docs)` (None: the whole row causal), and
                             reads of it "positions" (restarting per document) and/or "mask" (block-causal)
  recompute_plan() -> {..}   selective recompute (trainer.recompute_modules): per module name of
                             config/train.py RECOMPUTE_MODULES the (sub-module path, method, weights..)
                             calls that recompute re-runs in B (parallel/recompute.py); a name missing:
                             none here
  nodes(key) -> [Node]       node-level execution (runtime/stage_protocol.py Node): the layer's forward as
                             nodes, named by schedules/fb_pairs.py's constants for an MoE block
                             (models/moe_nodes.py); a layer without it runs as one node
  layer_loss(out, y, inputs) the last layer computes its stage's loss itself, reading the microbatch's
                             inputs too where loss_reads_inputs() (multi-token prediction: models/mtp.py)

parallel/ applies any of these without knowing the model classes: the models import this vocabulary
(downward), parallel/ imports nothing of models/ (torchtitan keeps each model's `parallelize_fn`
beside the model the same way). This file imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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
    # stacked-experts modules ((E, I, H) w1, w3 and (E, H, I) w2) split in every expert's width I, column then
    # row as the dense MLP (expert tensor parallel, etp = tp); their `tp_region` enters and leaves the region
    experts: tuple[str, ...] = ()

    def partial_names(self, sequence_parallel: bool) -> list[str]:
        return [*self.partial, *(self.partial_sp if sequence_parallel else ())]


@runtime_checkable
class TPPlanned(Protocol):
    """A layer that declares its tensor-parallel plan."""

    def tp_plan(self) -> TPLayerPlan: ...


@runtime_checkable
class ExpertsPlanned(Protocol):
    """A layer that says where its stacked experts are."""

    def ep_plan(self) -> tuple[str, ...]: ...


@runtime_checkable
class ContextPlanned(Protocol):
    """A layer that says which of its modules attend across positions (they get a ContextAttention)."""

    def cp_plan(self) -> tuple[str, ...]: ...


@runtime_checkable
class NodesPlanned(Protocol):
    """A layer that runs as nodes under node-level execution (runtime/stage_protocol.py Node)."""

    def nodes(self, key: str) -> list[Any]: ...


@runtime_checkable
class LossPlanned(Protocol):
    """A last layer that computes its stage's loss itself, from its output, the targets and the microbatch's
    inputs (multi-token prediction reads the tokens ahead: models/mtp.py WithMTP)."""

    def loss_reads_inputs(self) -> bool: ...

    def layer_loss(self, output: Any, target: Any, inputs: Any) -> Any: ...


DOCUMENT_READS = ("positions", "mask")  # what a DocumentsPlanned layer may read of a microbatch's Documents


@runtime_checkable
class DocumentsPlanned(Protocol):
    """A layer whose forward takes the microbatch's documents, `layer(x, docs)`, and reads of them
    `documents_plan()` (of DOCUMENT_READS): GPT-2's embedding the positions, attention blocks the mask."""

    def documents_plan(self) -> tuple[str, ...]: ...


@runtime_checkable
class RecomputePlanned(Protocol):
    """A layer that says which of trainer.recompute_modules it has: module name -> the calls selective
    recompute wraps, each (sub-module path ("" for the layer itself), method name, then the paths under
    that sub-module of those whose weights the call uses: a `forward` uses all of its own, another
    method none unless named; MLA's up-projections name theirs)."""

    def recompute_plan(self) -> dict[str, tuple[tuple[str, ...], ...]]: ...
