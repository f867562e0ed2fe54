"""Partition strategies, Partition and the partition table (pure: no torch).

The exact strategies are checked against a brute-force search over every contiguous cut
of small random models, including the documented tie-break, and against a greedy pass."""

from __future__ import annotations

import io
import itertools
import random
from fractions import Fraction
from pathlib import Path

import pytest
from rich.console import Console

from conftest import assert_torch_free
from pipetrain.partition.costs import LayerCost, chunk_costs
from pipetrain.partition.partition import Partition, imbalance
from pipetrain.partition.strategies import (
    STRATEGIES,
    exact_ints,
    min_max_bounds,
    partition,
)
from pipetrain.partition.table import compact_names, human, partition_table
from pipetrain.partition.uniform import uniform_bounds

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
EXACT = ("params", "flops", "time", "balanced")
METRIC_OF = {"params": lambda l: l.params, "flops": lambda l: l.flops_per_token, "time": lambda l: l.total_ms}


# ---- helpers -------------------------------------------------------------------------


def random_value(rng: random.Random, *, integer: bool = False) -> float:
    """Costs with many ties and zeros, plus wide-range floats that stress exact arithmetic."""
    kind = rng.random()
    if kind < 0.45:
        v = rng.choice([0, 0, 1, 1, 2, 3, 0.1, 0.2, 0.3])
    elif kind < 0.8:
        v = rng.uniform(0, 10)
    else:
        v = rng.random() * 2.0 ** rng.randint(-40, 40)
    return round(v * 7) if integer else float(v)


def random_layers(rng: random.Random, n: int) -> list[LayerCost]:
    return [
        LayerCost(
            f"h.{i}", random_value(rng), random_value(rng), random_value(rng),
            params=random_value(rng, integer=True), flops_per_token=random_value(rng),
        )
        for i in range(n)
    ]


def all_cuts(n: int, k: int):
    """Every cut of n layers into k non-empty contiguous chunks, as boundary tuples."""
    return itertools.combinations(range(1, n), k - 1)


def chunks_of(weights: list, cut: tuple[int, ...]) -> list:
    edges = [0, *cut, len(weights)]
    return [sum((Fraction(w) for w in weights[a:b]), Fraction(0)) for a, b in itertools.pairwise(edges)]


def brute_force(weights: list, k: int) -> tuple[Fraction, tuple[int, ...]]:
    """(optimal max chunk, cut chosen by the documented tie-break), over all cuts, exactly."""
    exact = [Fraction(w) for w in weights]
    n = len(weights)

    def key(cut):
        sums, edges = chunks_of(exact, cut), [0, *cut, n]
        counts = [b - a for a, b in itertools.pairwise(edges)]
        return (max(sums), sum(s * s for s in sums), sum(c * c for c in counts), tuple(-b for b in cut))

    best = min(all_cuts(n, k), key=key)
    return max(chunks_of(exact, best)), best


def greedy(weights: list, k: int) -> tuple[int, ...]:
    """A plain greedy pass: close a chunk when the next layer would push it past total/k."""
    target = sum(Fraction(w) for w in weights) / k
    cuts, current = [], Fraction(0)
    for i, w in enumerate(weights):
        chunks_left = k - 1 - len(cuts)
        if i > 0 and chunks_left > 0 and (current + Fraction(w) > target or len(weights) - i == chunks_left):
            cuts.append(i)
            current = Fraction(0)
        current += Fraction(w)
    assert len(cuts) == k - 1
    return tuple(cuts)


def assert_invariants(plan: Partition, n: int, k: int) -> None:
    assert len(plan.bounds) == k
    assert [i for r in plan.bounds for i in r] == list(range(n))  # cover, once, in order
    assert all(len(r) > 0 and r.step == 1 for r in plan.bounds)


def gpt2_like(n_layer: int = 12) -> list[LayerCost]:
    V, C, T = 50257, 768, 1024
    blk = 12 * C * C + 13 * C
    out = [LayerCost("transformer.wte+wpe", 0.2, 0.2, 0.3, params=V * C + T * C)]
    out += [LayerCost(f"transformer.h.{i}", 1.0, 1.0, 1.0, params=blk, flops_per_token=2 * blk + 2 * T * C)
            for i in range(n_layer)]
    out += [LayerCost("transformer.ln_f", 0.01, 0.01, 0.01, params=2 * C, flops_per_token=5 * C),
            LayerCost("lm_head", 3.0, 3.0, 3.0, params=0, flops_per_token=2 * V * C)]
    return out


# ---- exactness: brute force, tie-break, greedy ------------------------------------------


def test_exact_strategies_match_brute_force_and_beat_greedy():
    rng = random.Random(20240603)
    cases = 0
    for _ in range(500):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        layers = random_layers(rng, n)
        for strategy in EXACT:
            metric = strategy if strategy != "balanced" else next(
                (m for m in ("time", "flops", "params") if any(METRIC_OF[m](l) for l in layers)), None)
            if metric is None:  # every cost is zero: balanced falls back to equal layer counts
                assert partition(layers, k, strategy).bounds == tuple(uniform_bounds(n, k))
                continue
            weights = [METRIC_OF[metric](l) for l in layers]
            if not any(weights):
                with pytest.raises(ValueError, match=f"partition={strategy} has nothing to balance"):
                    partition(layers, k, strategy)
                continue
            plan = partition(layers, k, strategy)
            assert_invariants(plan, n, k)
            assert plan.balanced_on == metric
            opt, cut = brute_force(weights, k)
            got = chunks_of(weights, plan.boundaries)
            assert max(got) == opt, (strategy, weights, k, plan.boundaries)
            assert plan.boundaries == cut, (strategy, weights, k)  # the documented tie-break
            assert max(plan.chunk_sums(metric)) == float(opt)  # fsum sums round the exact optimum
            assert max(got) <= max(chunks_of(weights, greedy(weights, k)))
            cases += 1
    assert cases > 1000


def test_greedy_can_be_strictly_worse_than_exact():
    # Greedy closes [1, 5] because adding 9 passes total/k = 11.7, then [9] before 8:
    # the last chunk gets 8 + 7 + 5 = 20; the exact cut is [1, 5, 9] [8, 7] [5] = 15.
    weights = [1.0, 5.0, 9.0, 8.0, 7.0, 5.0]
    assert max(chunks_of(weights, greedy(weights, 3))) == 20
    assert max(chunks_of(weights, partition_weights(weights, 3))) == 15


def test_tie_break_balances_stages_below_the_maximum():
    # A heavy last layer (like GPT-2's vocabulary head) sets the maximum (10) by itself; the
    # tie-break then balances the other stages (3, 3, 2) instead of packing one up to 10.
    exact = min_max_bounds([1.0] * 8 + [10.0], 4)
    assert [len(r) for r in exact] == [3, 3, 2, 1]


def partition_weights(weights: list, k: int) -> tuple[int, ...]:
    return tuple(r.start for r in min_max_bounds(weights, k)[1:])


def test_float_costs_are_compared_exactly():
    # 0.1 + 0.2 > 0.3 in binary floating point; an exact search must see that.
    assert exact_ints([0.1, 0.2, 0.3])[0] + exact_ints([0.1, 0.2, 0.3])[1] > exact_ints([0.1, 0.2, 0.3])[2]
    for weights in ([0.1, 0.2, 0.3], [0.3, 0.1, 0.2], [1e-300, 1e300, 5e-324, 1.0]):
        for k in range(1, len(weights) + 1):
            bounds = min_max_bounds(weights, k)
            _opt, cut = brute_force(weights, k)
            assert tuple(r.start for r in bounds[1:]) == cut


def test_equal_and_zero_costs_give_uniform_counts():
    for n in range(1, 13):
        for k in range(1, n + 1):
            same = [LayerCost(f"l{i}", 1.0, 2.0, 0.5, params=7, flops_per_token=3.0) for i in range(n)]
            zero = [LayerCost(f"l{i}", 0.0, 0.0, 0.0) for i in range(n)]
            want = tuple(uniform_bounds(n, k))
            for strategy in EXACT:
                assert partition(same, k, strategy).bounds == want
            assert partition(zero, k, "balanced").bounds == want
            assert partition(zero, k, "balanced").balanced_on == "layers"


def test_balanced_prefers_time_then_flops_then_params():
    timed = [LayerCost("a", 1.0, 0.0, 0.0, params=5, flops_per_token=9.0), LayerCost("b", 0.0, 0.0, 0.0, params=1)]
    assert partition(timed, 2, "balanced").balanced_on == "time"
    no_time = [LayerCost("a", 0, 0, 0, params=5, flops_per_token=1.0), LayerCost("b", 0, 0, 0, params=1)]
    assert partition(no_time, 2, "balanced").balanced_on == "flops"
    only_params = [LayerCost("a", 0, 0, 0, params=5), LayerCost("b", 0, 0, 0, params=1)]
    assert partition(only_params, 2, "balanced").balanced_on == "params"


def test_gpt2_like_balanced_is_never_worse_than_uniform_in_time():
    layers = gpt2_like()
    for k in (2, 4, 8, 15):
        uni, bal = partition(layers, k, "uniform"), partition(layers, k, "balanced")
        assert max(bal.chunk_time_ms()) <= max(uni.chunk_time_ms())
    assert max(partition(layers, 3, "balanced").chunk_time_ms()) < max(partition(layers, 3, "uniform").chunk_time_ms())


def test_exact_is_fast_enough_for_big_models():
    rng = random.Random(1)
    layers = [LayerCost(f"h.{i}", rng.uniform(0.5, 2), 1.0, 1.0) for i in range(200)]
    plan = partition(layers, 32, "time")  # O(k n^2) with early exits: well under a second
    assert_invariants(plan, 200, 32)


# ---- uniform, manual and errors -------------------------------------------------------


def test_uniform_counts():
    for n in range(1, 25):
        for k in range(1, n + 1):
            counts = [len(r) for r in partition([LayerCost(f"l{i}", 1, 1, 1) for i in range(n)], k, "uniform").bounds]
            base, extra = divmod(n, k)
            assert counts == [base + 1] * extra + [base] * (k - extra)


def test_manual_boundaries_round_trip():
    layers = gpt2_like()
    plan = partition(layers, 4, "manual", boundaries=[3, 6, 9])
    assert plan.boundaries == (3, 6, 9)
    assert [len(r) for r in plan.bounds] == [3, 3, 3, 6]
    assert partition(layers, 1, "manual", boundaries=[]).bounds == (range(15),)
    # any plan's boundaries feed back into manual
    bal = partition(layers, 8, "balanced")
    assert partition(layers, 8, "manual", boundaries=list(bal.boundaries)).bounds == bal.bounds


@pytest.mark.parametrize("boundaries, match", [
    (None, "partition=manual needs partition.boundaries"),
    ([3, 6], "has 2 entries but 4 stages need 3"),
    ([3, 6, 9, 10], "has 4 entries"),
    ([0, 6, 9], r"partition.boundaries\[0\]=0 is out of range"),
    ([3, 6, 15], r"partition.boundaries\[2\]=15 is out of range"),
    ([3, 3, 9], "strictly increasing"),
    ([6, 3, 9], "strictly increasing"),
    ([3, 6.5, 9], "integer layer indices"),
    ([3, True, 9], "integer layer indices"),
])
def test_manual_boundaries_errors(boundaries, match):
    with pytest.raises(ValueError, match=match) as err:
        partition(gpt2_like(), 4, "manual", boundaries=boundaries)
    assert "partition.boundaries" in str(err.value) and "\n" not in str(err.value)


def test_more_chunks_than_layers_raises():
    layers = [LayerCost(f"l{i}", 1, 1, 1) for i in range(8)]
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match="cannot cut 8 layers into 16 stages: lower pipeline.degree or "
                                             "schedule.virtual_stages"):
            partition(layers, 16, strategy, boundaries=list(range(1, 16)) if strategy == "manual" else None)
    with pytest.raises(ValueError, match="cannot cut 8 layers into 9 stages"):
        uniform_bounds(8, 9)
    with pytest.raises(ValueError, match="must be >= 1"):
        partition(layers, 0, "uniform")


def test_bad_strategy_costs_and_knobs_raise_one_line_errors():
    layers = gpt2_like()
    bad = [
        (lambda: partition(layers, 4, "greedy"), "partition='greedy' is unknown"),
        (lambda: partition(layers, 4, "params", boundaries=[3, 6, 9]), "only read by partition=manual"),
        (lambda: partition([LayerCost("x", -1.0, 0, 0)], 1, "time"), "f_ms=-1.0"),
        (lambda: partition([LayerCost("x", 0, 0, 0, flops_per_token=float("nan"))], 1, "flops"), "flops_per_token=nan"),
        (lambda: partition([LayerCost("x", 1, 0, 0)], 1, "params"), "every layer's parameter count is 0"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


# ---- Partition ---------------------------------------------------------------------


def test_plan_rejects_invalid_bounds():
    layers = tuple(LayerCost(f"l{i}", 1, 1, 1) for i in range(6))
    for bounds in [
        (range(2), range(3, 6)),  # gap
        (range(3), range(2, 6)),  # overlap
        (range(3), range(3, 3), range(3, 6)),  # empty stage
        (range(3), range(3, 5)),  # misses a layer
        (range(1, 6),),  # misses layer 0
        (range(0, 6, 2),),  # not contiguous
    ]:
        with pytest.raises(ValueError) as err:
            Partition("manual", layers, bounds)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot cut 6 layers into 7 stages"):
        Partition("manual", layers, tuple(range(i, i + 1) for i in range(6)) + (range(6, 6),))


def test_plan_sums_and_imbalance():
    layers = gpt2_like()
    plan = partition(layers, 4, "manual", boundaries=[3, 7, 11])
    assert plan.num_chunks == 4 and plan.num_layers == 15
    assert plan.layer_names(0) == ["transformer.wte+wpe", "transformer.h.0", "transformer.h.1"]
    assert sum(plan.chunk_params()) == sum(l.params for l in layers)
    assert plan.chunk_fbw() == chunk_costs(layers, plan.bounds)
    assert plan.chunk_time_ms() == tuple(f + b + w for f, b, w in plan.chunk_fbw())
    assert plan.chunk_sums("layers") == (3, 4, 4, 4)
    assert plan.imbalance() == pytest.approx(4 / (15 / 4) - 1)  # manual balanced layer counts
    times = plan.chunk_time_ms()
    assert plan.time_imbalance() == pytest.approx(max(times) / (sum(times) / 4) - 1)
    assert imbalance([2.0, 2.0]) == 0.0 and imbalance([0, 0]) == 0.0 and imbalance([3, 1]) == 0.5


# ---- table -----------------------------------------------------------------------------


def render(table, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_compact_names_and_human_numbers():
    assert compact_names(["embed", "h.0", "h.1", "h.2"]) == "embed, h.0-2"
    assert compact_names(["h.3", "h.5", "h.6", "ln_f", "head"]) == "h.3, h.5-6, ln_f, head"
    assert compact_names(["a.1", "b.2"]) == "a.1, b.2"
    assert [human(x) for x in (0, 7, 38597376, 124_439_808, 1.5e9, 0.25)] == ["0", "7", "38.6M", "124M", "1.5G", "0.25"]


@pytest.mark.parametrize("n_layer, k, strategy", [(12, 4, "balanced"), (12, 8, "flops"), (48, 16, "params"),
                                                 (48, 50, "uniform"), (2, 1, "time")])
def test_table_fits_80_columns(n_layer, k, strategy):
    layers = gpt2_like(n_layer)
    plan = partition(layers, k, strategy)
    text = render(partition_table(plan, layers))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text
    for c in range(k):
        assert any(line.split()[:1] == [str(c)] for line in lines), f"stage {c} row missing"
    assert "imbalance" in text and "lm_head" in text and "transformer.wte+wpe" in text
    assert f"{100 * plan.time_imbalance():.1f}%" in text


def test_table_recosts_a_plan_with_other_layers():
    layers = gpt2_like()
    plan = partition(layers, 4, "flops")
    measured = [LayerCost(l.name, 2 * l.f_ms, 2 * l.b_ms, 2 * l.w_ms, params=l.params,
                          flops_per_token=l.flops_per_token) for l in layers]
    text = render(partition_table(plan, measured, title="measured"))
    assert "measured" in text and f"{max(plan.chunk_time_ms()) * 2:.2f}" in text
    with pytest.raises(ValueError, match="same model's layers"):
        partition_table(plan, layers[:-1])
    sleep = [LayerCost(f"layers.{i}", 1.0, 1.0, 1.0) for i in range(8)]
    text = render(partition_table(partition(sleep, 8, "balanced")))
    assert "FLOPs" not in text and "layers.7" in text  # no FLOPs column for a model without FLOPs


def test_partition_modules_do_not_load_torch():
    assert_torch_free("import pipetrain.partition.strategies, pipetrain.partition.table")
