"""Per-layer cost model shared by every model: what one layer costs for one microbatch.

Pure Python (no torch), so `mode=simulate` never needs torch.distributed or a device.
Times are per microbatch: f (forward), b (input-grad, B) and w (weight-grad, W) in ms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LayerCost:
    """One layer of a model, as the partitioner and the simulator see it."""

    name: str
    f_ms: float
    b_ms: float
    w_ms: float
    params: int = 0  # parameters stored by this layer (a tied copy counts where it is stored)
    flops_per_token: float = 0.0  # forward FLOPs per token (attention included)
    activation_bytes_per_token: int = 0  # bytes this layer keeps for its backward, per token

    @property
    def total_ms(self) -> float:
        return self.f_ms + self.b_ms + self.w_ms


def fuse_weight_grads(layers: Sequence[LayerCost]) -> list[LayerCost]:
    """The costs of layers compiled whole (trainer.compile): their backward computes the weight
    gradients with the input gradients, so B costs b + w and W nothing (schedules/lower.py lowers
    a compiled stage's B and W into one BW; this view is zb_auto's search input)."""
    return [dataclasses.replace(c, b_ms=c.b_ms + c.w_ms, w_ms=0.0) for c in layers]


def chunk_costs(layers: Sequence[LayerCost], bounds: Sequence[range]) -> list[tuple[float, float, float]]:
    """Sum layer costs over each chunk's layer range -> [(f, b, w)] per chunk."""
    # fsum: the same per-chunk totals whatever the layer order, so table and simulation agree exactly
    return [
        tuple(math.fsum(getattr(layers[i], key) for i in rng) for key in ("f_ms", "b_ms", "w_ms"))
        for rng in bounds
    ]
