"""Cut a LayeredModel into pipeline stages that keep the unsplit model's parameter names.

A stage holds deep copies of its layers in a ModuleDict keyed by the layers' global
indices, so a stage's parameter names are the unsplit model's names verbatim
("layers.0.wte.weight", "layers.9.lm_head.weight"): the union of the stages' state dicts
is the unsplit state dict, key for key (torchtitan keeps FQNs the same way, by deleting
the layers a stage does not own).

Tied parameters (GPT-2's wte / lm_head) are found from the unsplit model: every name under
which one Parameter object appears joins a tie group keyed by its canonical name (the one
`named_parameters()` reports). Each stage's layers are copied with ONE deepcopy call, so a
tie inside a stage stays one Parameter, and a tie across stages becomes separate Parameters
with equal values on each side. `StageModule.tied` marks them so the executor can sum their
gradients across ranks and keep the copies identical.

Copies make the function safe to call twice on the same model (DualPipe's mirror holds two
copies of every stage) and leave the model itself untouched.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.models.base import LayeredModel, LossFn
from pipetrain.models.init import InitRule, init_parameters
from pipetrain.parallel.layer_spec import DocumentsPlanned, LossPlanned, NodesPlanned
from pipetrain.models.moe_nodes import single_node
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.stage_protocol import Node


class StageModule(nn.Module):
    """Layers `layer_range` of a model, chained; parameter names are the unsplit names."""

    def __init__(self, layers: dict[int, nn.Module], *, stage_id: int, num_layers: int,
                 loss_fn: LossFn, tie_groups: dict[str, str]) -> None:
        super().__init__()
        idx = sorted(layers)
        self.layer_range = range(idx[0], idx[-1] + 1)
        self.stage_id = stage_id
        self.checkpoint_layers = False  # activation checkpointing (parallel/parallelize.py sets it)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == num_layers
        self.layers = nn.ModuleDict({str(i): layers[i] for i in idx})
        self._loss_fn = loss_fn if self.is_last else None
        # a last layer computing the loss itself (multi-token prediction: models/mtp.py), and whether that
        # loss reads the microbatch's inputs (the executor then hands them over: runtime/batch.py)
        last = layers[idx[-1]]
        self.loss_reads_inputs = self.is_last and isinstance(last, LossPlanned) and last.loss_reads_inputs()
        names = [n for n, _ in self.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in self.named_buffers(remove_duplicate=False)]
        self._names = frozenset(names)
        # local parameter name -> tie group (the canonical unsplit name of the tied weight)
        self.tied: dict[str, str] = {n: tie_groups[n] for n in names if n in tie_groups}
        # tensor parallel (parallel/tp_plan.py sets both): local name -> how it is split over the tp
        # group (parallel/tp.py: Split), and the whole weights whose gradients the tp group sums
        self.tp_shards: dict[str, Any] = {}
        self.tp_partial: tuple[str, ...] = ()
        self.ep_shards: dict[str, Any] = {}  # expert parallel (parallel/ep.py): stacked experts -> Split(0, E)
        # document masks (runtime/documents.py): the layers whose forward takes the documents, and whether
        # one of them reads the (B, 1, T, T) mask (then built once per forward)
        reads = {str(i): layers[i].documents_plan() for i in idx if isinstance(layers[i], DocumentsPlanned)}
        self._reads_docs = frozenset(reads)
        self._reads_mask = any("mask" in r for r in reads.values())

    def forward(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        """`docs` (data.document_mask): the microbatch's documents, its mask built here once for all
        the layers that read it (DocumentsPlanned) and handed to them as their second argument."""
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        if docs is not None and self._reads_mask:
            docs = docs.with_mask()  # (B, 1, T, T)
        for key, layer in self.layers.items():
            args = (x, docs) if docs is not None and key in self._reads_docs else (x,)
            # trainer.activation_checkpointing: keep only each layer's input and recompute its
            # forward when the backward (B, or W: non-reentrant checkpoint recomputes again if needed)
            # unpacks what it saved (the recompute gets the same documents, mask included).
            x = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return x

    def fb_plan(self) -> Optional[list[list[Node]]]:
        """The forward as nodes per layer (runtime/stage_protocol.py OverlapStage): a layer's own
        `nodes(key)` (models/moe_nodes.py) or the layer as one node. None under activation recompute
        (it re-runs a whole layer's forward in its backward): such stages run whole. Under FSDP2 the nodes
        bypass the layers' forward hooks: the executor's reducer gathers the parameters (`gather`)."""
        if self.checkpoint_layers:
            return None
        plan = []
        for key, layer in self.layers.items():
            end = self.is_last and int(key) == self.layer_range.stop - 1
            name = "embed" if int(key) == 0 else "head" if end else "layer"
            docs = isinstance(layer, DocumentsPlanned)  # the node reads "docs" too
            plan.append(layer.nodes(key) if isinstance(layer, NodesPlanned) else
                        single_node(layer, key, name, docs=docs))
        return plan

    @property
    def loss_fn(self) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """The loss of the last stage (None on the others): loss_fn(output, target)."""
        return self._loss_fn

    def set_loss(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Replace the last stage's loss (tensor parallel: the vocab-parallel cross-entropy)."""
        if not self.is_last:
            raise RuntimeError(f"stage {self.stage_id} (layers {self.layer_range}) is not the last: it has no loss")
        self._loss_fn = fn

    def loss(self, output: torch.Tensor, target: torch.Tensor, inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The microbatch's loss: the model's loss_fn, or the last layer's own (LossPlanned), whose (1 + D,)
        vector holds the loss and the parts reported beside it (runtime/step_loss.py)."""
        if self._loss_fn is None:
            raise RuntimeError(f"stage {self.stage_id} (layers {self.layer_range}) is not the last: it has no loss")
        last = self.layers[str(self.layer_range.stop - 1)]
        if isinstance(last, LossPlanned):
            return last.layer_loss(output, target, inputs)
        return self._loss_fn(output, target)

    def full_name(self, local_name: str) -> str:
        """Unsplit-model name of a local parameter or buffer (the same string, by construction)."""
        if local_name not in self._names:
            raise KeyError(f"stage {self.stage_id} has no parameter or buffer named {local_name!r}")
        return local_name

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """Tie group -> this stage's Parameter for it (one per group even when the stage holds
        several members of the group, as a stage with both embedding and head does)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        return {group: params[name] for name, group in sorted(self.tied.items())}


def tie_groups(model: nn.Module) -> dict[str, str]:
    """Name -> canonical name, for every parameter name that shares its Parameter with another."""
    by_param: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param[id(p)].append(name)
    return {n: names[0] for names in by_param.values() if len(names) > 1 for n in names}


def cut_stage(model: LayeredModel, layer_range: range, *, stage_id: int) -> StageModule:
    """One stage: deep copies of `model.layers[layer_range]` (only what this rank needs), where the
    model's parameters are (a model built on the meta device gives a meta stage: parallelize it,
    then materialize only this rank's parts: models/init.py)."""
    n = len(model.layers)
    if layer_range.step != 1 or len(layer_range) == 0 or layer_range.start < 0 or layer_range.stop > n:
        raise ValueError(f"stage {stage_id}: layer range {layer_range} must be a non-empty step-1 range in 0..{n}")
    picked = copy.deepcopy([model.layers[i] for i in layer_range])  # one memo: ties inside the stage survive
    return StageModule(dict(zip(layer_range, picked)), stage_id=stage_id, num_layers=n,
                       loss_fn=type(model).loss_fn, tie_groups=tie_groups(model))


def on_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def build_stage(model: LayeredModel, layer_range: range, *, stage_id: int, seed: int | None = None,
                device: Any = None, rule: InitRule | None = None) -> StageModule:
    """One whole stage (`cut_stage`) on `device`.

    A model built on the meta device (shapes only) gives a stage materialized here: each
    parameter allocated on `device` and initialised from (seed, its unsplit name), a tied
    copy under its tie group's name, so the stage holds exactly the weights the unsplit model
    built for real with the same seed holds (init.py).
    `rule` fills the values instead of the model's own init (models/hf.py: from safetensors files).
    """
    stage = cut_stage(model, layer_range, stage_id=stage_id)
    if on_meta(stage):
        if seed is None:
            raise ValueError(f"stage {stage_id}: the model was built on the meta device: pass seed= to initialise it")
        init_parameters(stage, rule or model, seed=seed, device=device, canonical=stage.tied)
    elif device is not None:
        stage.to(device)
    return stage


def split_model(model: LayeredModel, bounds: Sequence[range], *, seed: int | None = None,
                rule: InitRule | None = None) -> list[StageModule]:
    """All stages of a partition; `bounds` must tile 0..len(model.layers) in order."""
    n, expected = len(model.layers), 0
    for s, rng in enumerate(bounds):
        if rng.start != expected or rng.step != 1 or len(rng) == 0:
            raise ValueError(
                f"stage {s}: layers {rng} do not continue the partition at layer {expected}: "
                f"bounds must be non-empty contiguous ranges covering 0..{n - 1} in order"
            )
        expected = rng.stop
    if expected != n:
        raise ValueError(f"bounds cover layers 0..{expected - 1} but the model has {n} layers (0..{n - 1})")
    return [build_stage(model, rng, stage_id=s, seed=seed, rule=rule) for s, rng in enumerate(bounds)]
