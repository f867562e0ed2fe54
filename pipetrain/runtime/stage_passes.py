"""How a rank runs one pass of one of its stages: the one interface the executor calls.

The executor (runtime/executor.py) decides what runs when and where tensors go; a `StagePasses`
decides how a stage's forward, input-gradient backward (B) or full backward (BW) of one microbatch
runs. Two implement it:

  WholeStages              each pass one call: the stage module's forward, runtime/backward.py's
                           backward_input / backward_full over the whole stage
  NodeExecution            node by node (runtime/nodes.py), and an F&B pair's two passes interleaved
  (runtime/overlap.py)     (`pair`), under pipeline.fb_overlap

Per call, `head(stage, microbatch, out)` is what the executor makes of a forward's output (the loss
on a chain's last stage, else the output itself) and `wrap(stage, microbatch)` the context a pass's
compute runs in (the recorder's saved-bytes hooks, autocast); `wrap=None`: nothing to enter. A
forward returns (its output or loss, what its backward needs besides input and output); a backward
returns (the input's gradient, the weight-gradient work W runs later: runtime/backward.py).
`begin_step(reducer, docs)`: the step's documents by microbatch under document masks (runtime/documents.py;
empty without), handed to every forward of their microbatch.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

import torch

from pipetrain.runtime.backward import WeightGradWork, backward_full, backward_input
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.stage_protocol import Stage

Head = Callable[[int, int, torch.Tensor], torch.Tensor]
Wrap = Optional[Callable[[int, int], ContextManager]]
Grads = tuple[Optional[torch.Tensor], list[WeightGradWork]]


class StagePasses(Protocol):
    interleave: bool  # whether `pair` interleaves an F&B pair's two passes

    def begin_step(self, reducer: Any, docs: Mapping[int, Documents]) -> None: ...

    def forward(self, s: int, m: int, x: torch.Tensor, head: Head, wrap: Wrap) -> tuple[torch.Tensor, Any]: ...

    def backward(self, s: int, m: int, x: torch.Tensor, out: torch.Tensor, grad: Optional[torch.Tensor],
                 saved: Any, *, split: bool) -> Grads: ...


class WholeStages:
    """Each pass of a stage as one call (module docstring)."""

    interleave = False

    def __init__(self, stages: Mapping[int, Stage]) -> None:
        self.stages = stages
        self._params: dict[int, list[torch.nn.Parameter]] = {}
        self._docs: Mapping[int, Documents] = {}  # the step's documents by microbatch (document masks)

    def begin_step(self, reducer: Any, docs: Mapping[int, Documents]) -> None:
        # an FSDP2 stage's parameters are the unsharded tensors only after its first forward of the step
        self._params.clear()
        self._docs = docs

    def forward(self, s: int, m: int, x: torch.Tensor, head: Head, wrap: Wrap) -> tuple[torch.Tensor, Any]:
        stage, docs = self.stages[s], self._docs.get(m)
        if wrap is None:
            return head(s, m, stage(x) if docs is None else stage(x, docs)), None
        with wrap(s, m):
            return head(s, m, stage(x) if docs is None else stage(x, docs)), None

    def backward(self, s: int, m: int, x: torch.Tensor, out: torch.Tensor, grad: Optional[torch.Tensor],
                 saved: Any, *, split: bool) -> Grads:
        if split:
            grads, work = backward_input([out], [grad], [x], self._weights(s))
            return grads[0], [work]
        return backward_full([out], [grad], [x], self._weights(s))[0], []

    def _weights(self, s: int) -> list[torch.nn.Parameter]:
        if s not in self._params:
            self._params[s] = [p for p in self.stages[s].parameters() if p.requires_grad]
        return self._params[s]
