"""What the executor needs of a stage: the protocol runtime/ can depend on instead of models/.

The executor runs a stage's forward, asks the last stage for the loss, and collects the
parameters it computes weight gradients for. The parallelize steps and the gradient sync read
the rest: the stage's layers, its tie groups, its tensor-parallel splits and whether it recomputes.
`models/split.py: StageModule` is the implementation; runtime/, parallel/ and train/ read no
other attribute of a stage (tests/test_architecture.py checks that no `getattr(stage, "...")`
reaches for an undeclared one, and tests/test_assembly.py that a built stage carries none),
and runtime/ imports nothing of models/ (train/pipeline.py assembles a rank's stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, runtime_checkable

import torch

from pipetrain.runtime.documents import Documents


@runtime_checkable
class Stage(Protocol):
    """One pipeline stage on this rank: consecutive layers of the model."""

    stage_id: int
    is_first: bool  # holds the model's first layer (takes the batch's inputs)
    is_last: bool  # holds the model's last layer (computes the loss)
    layers: Mapping[str, torch.nn.Module]  # global layer index (a string) -> the layer
    tied: Mapping[str, str]  # local parameter name -> tie group (the canonical unsplit name)
    tp_shards: Mapping[str, Any]  # local name -> how it is split over the tp group (parallel/tp.py: Split)
    tp_partial: tuple[str, ...]  # whole weights whose gradients the tp group sums after a step
    ep_shards: Mapping[str, Any]  # local name -> how its experts are split over the ep group (Split(0, E))
    checkpoint_layers: bool  # recompute each layer's forward in its backward
    loss_reads_inputs: bool  # its loss reads the microbatch's inputs besides the targets (multi-token prediction)

    def __call__(self, x: torch.Tensor, docs: Optional[Documents] = None) -> torch.Tensor:
        """Forward of one microbatch: (microbatch, ...) in, the next stage's input out. `docs`: the
        microbatch's documents (runtime/documents.py) under data.document_mask, else None (never passed)."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor, inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of one microbatch; only the last stage has one. A scalar, or a (1 + D,) vector: the loss
        and D parts reported beside it, detached (runtime/step_loss.py); `inputs`: the microbatch's inputs
        where `loss_reads_inputs`, else None."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        ...


@dataclass(frozen=True)
class Node:
    """One step of a stage's forward, for node-level execution (runtime/nodes.py, issue #29).

    Values flow by name through one environment per microbatch: the stage input and every layer's
    output is "x", the microbatch's Documents "docs" (None without document masks); a node reads
    `reads` and writes `writes` (later nodes may overwrite a name).
    A compute node runs `fn(*reads) -> writes` (a tuple) on detached leaves of its floating inputs, its
    weight gradients those of `params`. A comm node moves its one read to its one write by an
    expert-parallel all-to-all: `comm(env) -> (out_splits, in_splits, EPGroup)`, the reverse in backward.
    `modules` are read for their parameters when the backward runs, not when the plan is made: under FSDP2
    a module's parameters are other tensors once gathered (parallel/fsdp.py), and the graph uses those.
    """

    name: str  # attn | dispatch | experts | combine | post | layer | embed | head
    layer: str  # the global layer index
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    fn: Optional[Callable[..., tuple]] = None
    modules: tuple[torch.nn.Module, ...] = ()
    comm: Optional[Callable[[Mapping[str, Any]], tuple[list[int], list[int], Any]]] = None

    def params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters this node's weight gradients go to, as the modules hold them now."""
        return tuple(p for m in self.modules for p in m.parameters() if p.requires_grad)


@runtime_checkable
class OverlapStage(Protocol):
    """A stage that can run node by node: its forward as per-layer lists of nodes, in layer order."""

    def fb_plan(self) -> Optional[list[list[Node]]]:
        """None when this stage cannot (activation recompute)."""
        ...
