"""The executor's mixed precision (`compute_dtype`, e.g. bf16 for trainer.precision=bf16).

Parameters and their gradients stay fp32; every stage runs under torch.autocast, and a
floating-point output is cast to compute_dtype before it goes to the next stage, by P2P or by
local hand-off, so activations and, through the cast's autograd node, their gradients cross in
compute_dtype (the node turns the returning gradient back into the producer's dtype). Receive
buffers are in compute_dtype for floating-point boundaries (train/pipeline.py). The loss is fp32
(autocast runs cross-entropy and MSE in fp32), summed and all-reduced in fp64 (step_loss.py).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

_NO_AUTOCAST = contextlib.nullcontext()  # stateless: one for every forward without a compute dtype


class Precision:
    def __init__(self, device: torch.device, compute_dtype: Optional[torch.dtype]) -> None:
        self.device, self.compute_dtype = device, compute_dtype  # None: the parameters' dtype throughout

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def to_boundary(self, out: torch.Tensor) -> torch.Tensor:
        """A stage output as it crosses to the next stage: in compute_dtype when floating.

        The cast stays in the graph (kept by the executor as the output B/BW start from): the
        gradient coming back is then in compute_dtype too, and the cast's backward turns it
        into the dtype the stage produced (fp32 where a residual stream is fp32).
        """
        if self.compute_dtype is None or not out.is_floating_point():
            return out
        return out.to(self.compute_dtype)
