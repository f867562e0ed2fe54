"""Uniform partition: equal layer counts per chunk (the first chunks take the remainder)."""

from __future__ import annotations


def uniform_bounds(num_layers: int, num_chunks: int) -> list[range]:
    if num_chunks > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_chunks} stages: lower pipeline.degree or "
            f"schedule.virtual_stages, or raise the model's layer count"
        )
    base, extra = divmod(num_layers, num_chunks)
    out, start = [], 0
    for c in range(num_chunks):
        n = base + (1 if c < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
