"""Partition strategies: cut an ordered list of layer costs into contiguous chunks.

Pure Python (no torch). `params`, `flops`, `time` and `balanced` are exact: they minimise
the most expensive chunk over ALL contiguous cuts (the "linear partition" problem), never a
greedy pass, which can be arbitrarily worse when one layer (GPT-2's 50k-vocabulary head) is
heavy. Among the many cuts that reach that optimum, one is chosen deterministically:

  1. the smallest sum of squared chunk costs (the chunks that do not set the maximum are
     balanced too, rather than packed up to it);
  2. then the most even layer counts (smallest sum of squared counts: zero-cost layers are
     spread out, and equal costs give exactly `uniform`'s cut);
  3. then the lexicographically largest boundaries (earlier chunks take the extra layer, as
     `uniform` does).

Costs are floats, so all arithmetic is done on exact integers: every finite float is
m / 2**e, and scaling all costs by the largest 2**e makes them integers whose sums and
comparisons are exact. Complexity: O(k n^2) time and O(k n) memory for n layers and
k chunks, in two passes (the min-max value, then the tie-break among cuts reaching it);
both inner loops stop early once a chunk gets too expensive, so balanced cuts cost
about O(n^2) in practice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate, pairwise

from pipetrain.partition.costs import LayerCost
from pipetrain.partition.partition import METRICS, Partition, require_chunks
from pipetrain.partition.uniform import uniform_bounds

STRATEGIES = ("uniform", "params", "flops", "time", "balanced", "manual")
# `balanced` balances the best estimate the cost model has: time (measured or estimated
# f + b + w) when any layer has one, else forward FLOPs, else parameters, else layer count.
BALANCED_PREFERENCE = ("time", "flops", "params", "layers")
_WHAT = {"params": "parameter count", "flops": "flops_per_token", "time": "f_ms + b_ms + w_ms"}


def partition(
    layers: Sequence[LayerCost], num_chunks: int, strategy: str, *, boundaries: Sequence[int] | None = None
) -> Partition:
    """Cut `layers` into `num_chunks` contiguous non-empty chunks by `strategy` (see STRATEGIES).

    `boundaries` (partition=manual only) is the first layer index of chunks 1..k-1,
    e.g. [3, 6, 9] cuts 12 layers into 4 chunks of 3.
    """
    layers = tuple(layers)
    if strategy not in STRATEGIES:
        raise ValueError(f"partition={strategy!r} is unknown: choose one of {', '.join(STRATEGIES)}")
    if boundaries is not None and strategy != "manual":
        raise ValueError(
            f"partition.boundaries is only read by partition=manual (got partition={strategy}): "
            f"set partition=manual or remove partition.boundaries"
        )
    require_chunks(len(layers), num_chunks)
    check_costs(layers)
    if strategy == "uniform":
        return Partition(strategy, layers, tuple(uniform_bounds(len(layers), num_chunks)), "layers")
    if strategy == "manual":
        return Partition(strategy, layers, manual_bounds(len(layers), num_chunks, boundaries), "layers")
    if strategy == "balanced":
        metric = next(m for m in BALANCED_PREFERENCE if any(METRICS[m](layer) for layer in layers))
    else:
        metric = strategy
        if not any(METRICS[metric](layer) for layer in layers):
            raise ValueError(
                f"partition={strategy} has nothing to balance: every layer's {_WHAT[metric]} is 0 in this "
                f"model's cost model: choose partition=balanced or partition=uniform"
            )
    weights = [METRICS[metric](layer) for layer in layers]
    return Partition(strategy, layers, min_max_bounds(weights, num_chunks), metric)


def check_costs(layers: Sequence[LayerCost]) -> None:
    """Every cost a strategy may balance must be a finite number >= 0."""
    for layer in layers:
        for metric, key in (("params", "params"), ("flops", "flops_per_token"), ("time", "f_ms"),
                            ("time", "b_ms"), ("time", "w_ms")):
            value = getattr(layer, key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"layer {layer.name!r} has {key}={value!r}: per-layer costs must be finite numbers >= 0 "
                    f"(fix the model's cost model before partition={metric})"
                )


def manual_bounds(num_layers: int, num_chunks: int, boundaries: Sequence[int] | None) -> tuple[range, ...]:
    """Validate partition.boundaries (first layer of chunks 1..k-1) and turn it into ranges."""
    k = num_chunks
    example = [r.start for r in uniform_bounds(num_layers, k)[1:]]
    hint = f"e.g. partition.boundaries={example} for {num_layers} layers in {k} stages"
    if boundaries is None:
        raise ValueError(f"partition=manual needs partition.boundaries, the first layer of stages 1..{k - 1}: {hint}")
    cuts = list(boundaries)
    if any(isinstance(b, bool) or not isinstance(b, int) for b in cuts):
        raise ValueError(f"partition.boundaries must be a list of integer layer indices (got {cuts!r}): {hint}")
    if len(cuts) != k - 1:
        raise ValueError(
            f"partition.boundaries has {len(cuts)} entries but {k} stages need {k - 1} "
            f"(the first layer of stages 1..{k - 1}): {hint}"
        )
    for i, b in enumerate(cuts):
        if not 1 <= b <= num_layers - 1:
            raise ValueError(
                f"partition.boundaries[{i}]={b} is out of range: a stage's first layer must be in "
                f"1..{num_layers - 1} for {num_layers} layers ({hint})"
            )
    if any(a >= b for a, b in pairwise(cuts)):
        raise ValueError(
            f"partition.boundaries must be strictly increasing so every stage gets a layer (got {cuts}): {hint}"
        )
    edges = [0, *cuts, num_layers]
    return tuple(range(a, b) for a, b in pairwise(edges))


# ---- the exact min-max cut -------------------------------------------------------------


def min_max_bounds(weights: Sequence[float], num_chunks: int) -> tuple[range, ...]:
    """The contiguous cut of `weights` into `num_chunks` non-empty chunks whose largest chunk
    sum is minimal, tie-broken as the module docstring says. Weights must be finite, >= 0."""
    require_chunks(len(weights), num_chunks)
    prefix = list(accumulate(exact_ints(weights), initial=0))
    cap = _min_max_value(prefix, num_chunks)
    ends = _tie_break(prefix, num_chunks, cap)
    return tuple(range(a, b) for a, b in zip([0, *ends], ends))


def exact_ints(values: Sequence[float]) -> list[int]:
    """Scale finite non-negative floats/ints to integers exactly (same ratios, exact sums)."""
    fracs = [Fraction(v) for v in values]
    # Denominators of floats are powers of two, so the largest is a multiple of all of them.
    scale = max(f.denominator for f in fracs)
    return [f.numerator * (scale // f.denominator) for f in fracs]


def _min_max_value(prefix: list[int], k: int) -> int:
    """min over cuts into k chunks of the largest chunk sum; prefix[j] = sum of layers 0..j-1.

    best[j] = optimum for layers 0..j-1 in c chunks; the last chunk is layers i..j-1.
    Walking i downwards, the last chunk only grows, so once it alone reaches the best
    value found no smaller i can do better."""
    n = len(prefix) - 1
    best: list[float] = [math.inf, *prefix[1:]]  # c = 1: one chunk holds layers 0..j-1
    for c in range(2, k + 1):
        new: list[float] = [math.inf] * (n + 1)
        for j in range(c, n - (k - c) + 1):  # the chunks after c need k - c layers
            val: float = math.inf
            for i in range(j - 1, c - 2, -1):  # the first c - 1 chunks need i >= c - 1 layers
                seg = prefix[j] - prefix[i]
                if seg >= val:
                    break
                val = min(val, max(best[i], seg))
            new[j] = val
        best = new
    return int(best[n])


def _tie_break(prefix: list[int], k: int, cap: int) -> list[int]:
    """Chunk end indices of the cut with every chunk <= cap that minimises
    (sum of squared chunk costs, sum of squared layer counts), then has the
    lexicographically largest boundaries.

    A suffix DP: score[c][i] is the best way to cut layers i..n-1 into chunks c..k-1.
    Both objectives are sums over chunks, so comparing (cost², count²) tuples is exact;
    scanning chunk ends upwards and keeping ties (<=) picks the latest end at every
    state, which from the front is the lexicographically largest boundary sequence."""
    n = len(prefix) - 1
    score: list[list[tuple[int, int] | None]] = [[None] * (n + 1) for _ in range(k + 1)]
    end = [[0] * (n + 1) for _ in range(k)]
    score[k][n] = (0, 0)
    for c in range(k - 1, -1, -1):
        for i in range(c, n - (k - c) + 1):  # chunk c starts at layer i
            best = None
            for j in range(i + 1, n - (k - c - 1) + 1):  # ... and ends before layer j
                seg = prefix[j] - prefix[i]
                if seg > cap:
                    break
                rest = score[c + 1][j]
                if rest is None:
                    continue
                cand = (seg * seg + rest[0], (j - i) ** 2 + rest[1])
                if best is None or cand <= best:
                    best, end[c][i] = cand, j
            score[c][i] = best
    assert score[0][0] is not None, "the min-max cut must satisfy its own cap"
    ends, i = [], 0
    for c in range(k):
        i = end[c][i]
        ends.append(i)
    return ends
