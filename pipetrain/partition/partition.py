"""Partition: which contiguous layers each model chunk holds, and what each chunk costs.

Pure Python (no torch). A chunk is one pipeline stage's share of the model: with
pipeline.degree ranks and v stages per rank there are degree * v chunks, and chunk s is
stage s of the schedule (Placement maps stages to ranks; the plan does not care).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.partition.costs import LayerCost, chunk_costs

# What a strategy can balance, as one number per layer. "layers" counts layers, which is
# what `uniform` and `manual` do (they look at no cost at all).
METRICS: dict[str, Callable[[LayerCost], float]] = {
    "layers": lambda layer: 1,
    "params": lambda layer: layer.params,
    "flops": lambda layer: layer.flops_per_token,
    "time": lambda layer: layer.total_ms,
}


def require_chunks(num_layers: int, num_chunks: int) -> None:
    """Raise the one-line error for a stage count the model cannot be cut into."""
    if num_chunks < 1:
        raise ValueError(
            f"cannot cut a model into {num_chunks} stages: pipeline.degree and schedule.virtual_stages must be >= 1"
        )
    if num_layers < 1:
        raise ValueError("cannot partition a model with no layers: the model's cost model returned an empty list")
    if num_chunks > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_chunks} stages: lower pipeline.degree or "
            f"schedule.virtual_stages, or raise the model's layer count"
        )


def total(values: Sequence[float]) -> float:
    """Exact integer sum, or the correctly rounded float sum (math.fsum): the same numbers
    give the same total in any order, so plans and tables never disagree by an ulp."""
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return math.fsum(values)


def imbalance(values: Sequence[float]) -> float:
    """max/mean - 1: 0.0 is perfectly balanced; 0.25 means the slowest chunk is 25% above the mean."""
    if not values:
        return 0.0
    mean = total(values) / len(values)
    return max(values) / mean - 1.0 if mean > 0 else 0.0


@dataclass(frozen=True)
class Partition:
    """Chunk c holds layers bounds[c] (contiguous, non-empty, in order, covering every layer once).

    `balanced_on` names the METRICS entry the strategy balanced ("layers" for uniform and
    manual). The plan keeps the layer costs it was made from, so it can report per-chunk
    sums; `replace(plan, layers=measured)` re-costs the same cut with other numbers.
    """

    strategy: str
    layers: tuple[LayerCost, ...]
    bounds: tuple[range, ...]
    balanced_on: str = "layers"

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a one-line ValueError if the plan is not a valid cut of its layers."""
        n, k = len(self.layers), len(self.bounds)
        require_chunks(n, k)
        if self.balanced_on not in METRICS:
            raise ValueError(f"partition balanced_on={self.balanced_on!r} is unknown: use one of {sorted(METRICS)}")
        start = 0
        for c, rng in enumerate(self.bounds):
            if not isinstance(rng, range) or rng.step != 1 or rng.start != start or len(rng) == 0:
                raise ValueError(
                    f"stage {c} holds layers {_show(rng)} but must start at layer {start} and hold at least one: "
                    f"partition.boundaries must be strictly increasing first-layer indices"
                )
            start = rng.stop
        if start != n:
            raise ValueError(
                f"the stages cover layers 0..{start - 1} of {n}: partition.boundaries must leave every layer in a stage"
            )

    # ---- shape -------------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First layer index of chunks 1..k-1: the form partition=manual takes back."""
        return tuple(rng.start for rng in self.bounds[1:])

    def layer_names(self, chunk: int) -> list[str]:
        return [self.layers[i].name for i in self.bounds[chunk]]

    # ---- per-chunk sums ----------------------------------------------------------------

    def chunk_sums(self, metric: str) -> tuple[float, ...]:
        """Per-chunk total of one METRICS entry ("layers", "params", "flops", "time")."""
        if metric not in METRICS:
            raise ValueError(f"unknown partition metric {metric!r}: use one of {sorted(METRICS)}")
        get = METRICS[metric]
        return tuple(total([get(self.layers[i]) for i in rng]) for rng in self.bounds)

    def chunk_params(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.chunk_sums("params"))

    def chunk_flops(self) -> tuple[float, ...]:
        return self.chunk_sums("flops")

    def chunk_time_ms(self) -> tuple[float, ...]:
        """Estimated f + b + w ms of one microbatch through each chunk."""
        return self.chunk_sums("time")

    def chunk_fbw(self) -> list[tuple[float, float, float]]:
        """[(f, b, w) ms] per chunk: what StageCosts.from_chunks takes."""
        return chunk_costs(self.layers, self.bounds)

    # ---- balance -----------------------------------------------------------------------

    def imbalance(self, metric: str | None = None) -> float:
        """max/mean - 1 of `metric` (default: the cost the strategy balanced)."""
        return imbalance(self.chunk_sums(metric or self.balanced_on))

    def time_imbalance(self) -> float:
        """max/mean - 1 of estimated time: what bounds a pipeline's throughput."""
        return self.imbalance("time")


def _show(rng: object) -> str:
    if isinstance(rng, range) and rng.step == 1:
        return f"{rng.start}..{rng.stop - 1}" if len(rng) else f"none (empty range at {rng.start})"
    return repr(rng)
