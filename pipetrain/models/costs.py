"""Per-layer cost model shared by every model: what one layer costs for one microbatch.

Pure Python (no torch), so `mode=simulate` never needs torch.distributed or a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LayerCost:
    """Time (ms) of one microbatch through one layer: forward, input-grad (B), weight-grad (W)."""

    name: str
    f_ms: float
    b_ms: float
    w_ms: float
    params: int = 0
    activation_bytes: int = 0


def chunk_costs(layers: Sequence[LayerCost], bounds: Sequence[range]) -> list[tuple[float, float, float]]:
    """Sum layer costs over each chunk's layer range -> [(f, b, w)] per chunk."""
    out = []
    for rng in bounds:
        sel = [layers[i] for i in rng]
        out.append((sum(c.f_ms for c in sel), sum(c.b_ms for c in sel), sum(c.w_ms for c in sel)))
    return out
