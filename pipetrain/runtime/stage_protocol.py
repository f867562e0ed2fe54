"""What the executor needs of a stage: the protocol runtime/ can depend on instead of models/.

The executor runs a stage's forward, asks the last stage for the loss, and collects the
parameters it computes weight gradients for; it needs nothing else of the module.
`models/split.py: StageModule` is the implementation; the executor's `stages` are typed
with this protocol, and runtime/ imports nothing of models/ (train/pipeline.py assembles a
rank's stages from the model). tests/test_architecture.py checks both.
"""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stage(Protocol):
    """One pipeline stage on this rank: consecutive layers of the model."""

    stage_id: int
    is_first: bool  # holds the model's first layer (takes the batch's inputs)
    is_last: bool  # holds the model's last layer (computes the loss)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of one microbatch: (microbatch, ...) in, the next stage's input out."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The scalar loss of one microbatch; only the last stage has one."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        ...
