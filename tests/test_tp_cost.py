"""The simulator's tensor-parallel cost model (pure): a layer's compute divided by tp, its TP
collectives added at cluster.tp_bandwidth_gbs, and the plan the simulator runs reading both;
under trainer.compile a stage's W folded into its B, as the executor runs it."""

from __future__ import annotations

import pytest

from pipetrain.partition.costs import LayerCost
from pipetrain.plan import make_plan
from pipetrain.schedules.tp_cost import tp_layer_costs

pytestmark = pytest.mark.pure

LAYERS = [LayerCost("embed", 0.0, 0.0, 0.0, params=1000, activation_bytes_per_token=8),
          LayerCost("h.0", 4.0, 4.0, 2.0, params=1001, flops_per_token=10.0, activation_bytes_per_token=400),
          LayerCost("head", 2.0, 2.0, 2.0, params=500, activation_bytes_per_token=100)]


def test_compute_divides_and_each_layer_adds_its_collectives():
    # 1000 tokens x 250 hidden x 4 bytes = 1 MB per activation; tp=4: ring all-reduce 2 x 3/4 = 1.5 MB
    # at 1 GB/s = 1.5 ms; the head's vocab-parallel loss: all-reduces of 1000 and 2000 fp32 values,
    # 3/2 x 12 KB = 0.018 ms (the (N, V) logits all-gather it replaced: 3/4 x 1000 x 500 x 4 B = 1.5 ms)
    got = tp_layer_costs(LAYERS, tp=4, tokens=1000, hidden=250, vocab=500, bytes_per_value=4, bandwidth_gbs=1.0)
    embed, block, head = got
    assert (embed.f_ms, embed.b_ms, embed.w_ms) == pytest.approx((1.5, 0.0, 0.0))
    assert (block.f_ms, block.b_ms, block.w_ms) == pytest.approx((1.0 + 3.0, 1.0 + 3.0, 0.5))
    assert (head.f_ms, head.b_ms, head.w_ms) == pytest.approx((0.5 + 0.018, 0.5 + 1.5, 0.5))
    assert [c.params for c in got] == [250, 251, 125] and block.flops_per_token == 2.5
    assert block.activation_bytes_per_token == 400  # whole without sequence parallel
    sp = tp_layer_costs(LAYERS, tp=4, tokens=1000, hidden=250, vocab=500, bytes_per_value=4, bandwidth_gbs=1.0,
                        sequence_parallel=True)
    assert sp[1].activation_bytes_per_token == 100 and sp[1].f_ms == block.f_ms  # same ring bytes
    assert tp_layer_costs(LAYERS, tp=1, tokens=1, hidden=1, vocab=1, bytes_per_value=4, bandwidth_gbs=1.0) == LAYERS
    # a calibrated latency per collective: embed F 1, block F 2 and B 2, head F 2 (the loss's) and B 1
    lat = tp_layer_costs(LAYERS, tp=4, tokens=1000, hidden=250, vocab=500, bytes_per_value=4, bandwidth_gbs=1.0,
                         latency_ms=0.25)
    # flat: pytest >= 9.2 refuses approx of nested sequences (a fresh install's pytest)
    assert [d for a, b in zip(lat, got) for d in (a.f_ms - b.f_ms, a.b_ms - b.b_ms, a.w_ms - b.w_ms)] == pytest.approx(
        [0.25, 0.0, 0.0, 0.5, 0.5, 0.0, 0.5, 0.25, 0.0])


def test_plan_stage_costs_follow_tp(compose):
    """The simulator's stages at tp=2: half the compute plus the bytes over the TP bandwidth;
    faster links leave only the halved compute."""
    base = ["mode=simulate", "model=gpt2-tiny", "data.batch_size=8", "data.seq_len=64", "pipeline.microbatches=4"]
    one = make_plan(compose(base)).stage_costs
    two = make_plan(compose([*base, "parallel.tp=2"])).stage_costs
    fast = make_plan(compose([*base, "parallel.tp=2", "cluster.tp_bandwidth_gbs=1e9"])).stage_costs
    for s in range(len(one.f)):
        assert fast.f[s] == pytest.approx(one.f[s] / 2, rel=1e-6) and fast.w[s] == pytest.approx(one.w[s] / 2)
        assert two.f[s] > fast.f[s] and two.b[s] > fast.b[s] and two.w[s] == pytest.approx(fast.w[s])
    sleep = make_plan(compose(["mode=simulate", "model=sleep", "parallel.tp=2", "model.layers=4"])).stage_costs
    assert sleep.w == (2.0 * 2 / 2,) * 2  # 2 layers of w_ms=2 per stage, halved


def test_compiled_stages_are_simulated_as_eager_ones(compose):
    """trainer.compile keeps B and W apart (parallel/parallelize.py apply_compile): the same costs."""
    base = ["mode=simulate", "model=gpt2-tiny", "data.batch_size=8", "schedule=zbv"]
    eager, compiled = (make_plan(compose([*base, f"trainer.compile={c}"])).stage_costs for c in ("false", "true"))
    assert compiled == eager and any(eager.w)
