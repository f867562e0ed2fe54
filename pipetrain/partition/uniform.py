"""Uniform partition: equal layer counts per chunk (the first chunks take the remainder)."""

from __future__ import annotations

from pipetrain.partition.partition import require_chunks


def uniform_bounds(num_layers: int, num_chunks: int) -> list[range]:
    require_chunks(num_layers, num_chunks)
    base, extra = divmod(num_layers, num_chunks)
    out, start = [], 0
    for c in range(num_chunks):
        n = base + (1 if c < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
