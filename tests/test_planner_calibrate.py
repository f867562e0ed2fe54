"""The planner's calibrated overheads: the fit from a run's metrics, and what each one adds to a
predicted step (pure: the sleep model, no processes)."""

from __future__ import annotations

import pytest

from pipetrain.compose import compose_config
from pipetrain.planner.calibrate import fit, overheads, tp_latency
from pipetrain.planner.cmd import make_rows

pytestmark = pytest.mark.pure

BASE = ["mode=plan", "model=sleep", "model.layers=8", "model.f_ms=10", "model.b_ms=10", "model.w_ms=10",
        "plan.world_size=2", "data.batch_size=4", "plan.microbatch_sizes=[1]", "plan.pp=[2]", "plan.prune=false",
        "plan.p2p_gbs=1000000"]


def _row(extra, schedule):
    rows, _ = make_rows(compose_config([*BASE, f"plan.schedules=[{schedule}]", *extra]))
    assert len(rows) == 1
    return rows[0]


def test_fit_separates_per_action_from_per_layer():
    # excess = 0.3 + 0.5 n, with noise around the medians
    samples = [(4, 2.3), (4, 2.2), (4, 2.4), (2, 1.3), (2, 1.2), (2, 1.4)]
    per_action, per_layer = fit(samples)
    assert per_action == pytest.approx(0.3) and per_layer == pytest.approx(0.5)
    assert fit([(4, 2.0), (4, 2.4)]) == (0.0, pytest.approx(0.55)), "one stage size: all per layer"


def test_overheads_from_metrics_rows():
    def metrics(n_stages, layers, excess, makespan):
        row = {"pipeline/makespan_with_reduce_ms": makespan, "pipeline/reduce_exposed_ms/rank0": 7.0,
               "pipeline/reduce_exposed_ms/rank1": 9.0, "pipeline/reduce_exposed_simulated_ms/rank0": 2.0,
               "pipeline/reduce_exposed_simulated_ms/rank1": 2.0}
        for s in range(n_stages):
            for op in ("f_ms", "b_ms", "w_ms"):
                row[f"pipeline/stage{s}/{op}"] = 10.0 * layers + excess
        return row

    def model(layers):  # the planner's time of each stage: 10 ms per layer and op
        return {op: [10.0 * n for n in layers] for op in ("f_ms", "b_ms", "w_ms")}

    runs = [([metrics(2, 4, 0.2 + 4 * 0.6, 500.0)], 512.0, [4, 4], model([4, 4])),
            ([metrics(4, 2, 0.2 + 2 * 0.6, 480.0)], 490.0, [2, 2, 2, 2], model([2, 2, 2, 2]))]
    cal = overheads(runs)
    assert cal["action_overhead_ms"] == pytest.approx(0.2)
    assert cal["layer_overhead_ms"] == pytest.approx(0.6)
    assert cal["reduce_latency_ms"] == pytest.approx(6.0)
    assert cal["step_overhead_ms"] == pytest.approx(11.0)
    with pytest.raises(ValueError, match="log_every=1"):
        overheads([([], 1.0, [4], model([4]))])


def test_tp_latency_shares_the_f_excess_among_its_collectives():
    # stage 0: 3 layers, 5 collectives in F; stage 1: 2 layers, 3; action 1 ms, 0.5 ms per layer, 2 ms each
    rows = [{"pipeline/stage0/f_ms": 10.0 + 1.0 + 1.5 + 5 * 2.0, "pipeline/stage1/f_ms": 6.0 + 1.0 + 1.0 + 3 * 2.0}]
    got = tp_latency(rows, model_f_ms=[10.0, 6.0], layers=[3, 2], collectives=[5, 3], action_ms=1.0, layer_ms=0.5)
    assert got == pytest.approx(2.0)
    assert tp_latency(rows, model_f_ms=[99.0, 99.0], layers=[3, 2], collectives=[5, 3], action_ms=0, layer_ms=0) == 0
    with pytest.raises(ValueError, match="f_ms"):
        tp_latency([{}], model_f_ms=[1.0], layers=[1], collectives=[1], action_ms=0, layer_ms=0)


def test_each_overhead_adds_what_it_says():
    base = _row([], "1f1b").pred_step_ms
    assert _row(["plan.step_overhead_ms=7"], "1f1b").pred_step_ms == pytest.approx(base + 7)
    # 1f1b, pp2, M=4, 4 layers per stage: the critical path is 5 F and 5 BW. 0.5 ms per layer adds
    # 2 ms to an F and 4 to a BW (its B and W each); 2 ms per action adds 2 to both
    per_layer = _row(["plan.layer_overhead_ms=0.5"], "1f1b").pred_step_ms - base
    per_action = _row(["plan.action_overhead_ms=2"], "1f1b").pred_step_ms - base
    assert per_layer == pytest.approx(5 * 2 + 5 * 4) and per_action == pytest.approx(5 * 2 + 5 * 2)
    # BW is one action: 1f1b's steps take one action overhead, zbh1's B and W one each
    zb = _row([], "zbh1").pred_step_ms
    assert _row(["plan.action_overhead_ms=2"], "zbh1").pred_step_ms - zb > per_action
    # a dp reduction costs its latency once it is exposed
    dp = ["plan.world_size=4", "data.batch_size=8"]
    assert (_row([*dp, "plan.reduce_latency_ms=5"], "1f1b").pred_step_ms
            == pytest.approx(_row(dp, "1f1b").pred_step_ms + 5, abs=0.01))
    # a TP collective costs its latency (pp2 x tp2 gpipe, M=2): a block has 2 in its F and 2 in its B, a
    # stage 4 blocks, so every F and BW on the critical path (at least one of each) pays 8 or more
    tp = ["plan.world_size=4", "plan.tp=[2]", "data.batch_size=2"]
    base_tp = _row(tp, "gpipe").pred_step_ms
    assert _row([*tp, "plan.tp_latency_ms=1"], "gpipe").pred_step_ms > base_tp + 8
    with pytest.raises(ValueError, match="plan.action_overhead_ms must be >= 0"):
        compose_config([*BASE, "plan.action_overhead_ms=-1"])
