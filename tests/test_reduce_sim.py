"""Simulated data-parallel gradient reduction, pure: what a stage's reduction costs (ring factors,
dtype, mirrored copies), the serial communication lane per rank (exact arithmetic, a drain that
hides the reduction, overlap_reduce=false exposing all of it), how it is drawn and recorded, and
the measured side laid out as the simulator would run it."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from pipetrain.loggers.console import metrics_line, rank_table
from pipetrain.loggers.trace import measured_trace
from pipetrain.metrics.measure import measure_step
from pipetrain.plan import make_plan
from pipetrain.schedules import registry
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.reduce import add_reduces, check_reduces
from pipetrain.schedules.reduce_cost import reduce_ms, ring_factor, stage_params, wire_bytes
from pipetrain.schedules.render import chrome_trace, result_record, summary_table, timeline_lines
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.validate import validate
from test_metrics import samples_from_sim

pytestmark = pytest.mark.pure


# ---- cost: bytes on the wire over bandwidth -------------------------------------------------


def test_ring_factors():
    assert ring_factor(1, all_reduce=True) == 0.0 == ring_factor(1, all_reduce=False)
    assert ring_factor(2, all_reduce=True) == 1.0 and ring_factor(4, all_reduce=True) == 1.5
    assert ring_factor(2, all_reduce=False) == 0.5 and ring_factor(8, all_reduce=False) == 0.875
    S = 1000.0
    assert wire_bytes(S, dp_replicate=4, dp_shard=1) == 1500.0  # all-reduce 2(n-1)/n
    assert wire_bytes(S, dp_replicate=1, dp_shard=4) == 750.0  # reduce-scatter (n-1)/n
    # HSDP: reduce-scatter over 4 shards, then all-reduce of the quarter over 2 replicas
    assert wire_bytes(S, dp_replicate=2, dp_shard=4) == 750.0 + 1.0 * 250.0


def test_reduce_ms_is_bytes_over_bandwidth():
    # 1M fp32 parameters = 4 MB; all-reduce over 2 ranks moves 4 MB per rank; 50 GB/s -> 0.08 ms
    assert reduce_ms([1e6], dp_replicate=2, dp_shard=1, bandwidth_gbs=50.0) == pytest.approx((0.08,))
    assert reduce_ms([1e6], dp_replicate=2, dp_shard=1, bandwidth_gbs=50.0,
                     reduce_dtype="bfloat16") == pytest.approx((0.04,))
    assert reduce_ms([1e6, 0], dp_replicate=1, dp_shard=4, bandwidth_gbs=1.0) == pytest.approx((3.0, 0.0))
    with pytest.raises(ValueError, match="cluster.dp_bandwidth_gbs must be > 0"):
        reduce_ms([1.0], dp_replicate=2, dp_shard=1, bandwidth_gbs=0.0)


def test_mirrored_stages_each_reduce_their_copy():
    sched = registry.build("dualpipe", 2, 4, 2)  # 4 stages over 2 chunks: stage s holds chunk_of(s)
    pl = sched.placement
    assert stage_params(sched, [10, 20]) == tuple(float([10, 20][pl.chunk_of(s)]) for s in range(4))
    assert sorted(stage_params(sched, [10, 20])) == [10.0, 10.0, 20.0, 20.0]
    with pytest.raises(ValueError, match="2 model chunks"):
        stage_params(sched, [1, 2, 3])


def test_plan_reduce_ms_from_the_config(compose):
    # 4 sleep layers of 1M weights, 2 per stage: 8 MB per stage; all-reduce over 2 at 1 GB/s = 8 ms
    knobs = ["mode=simulate", "model=sleep", "model.layers=4", "model.params_per_layer=1000000",
             "parallel.dp_replicate=2", "cluster.dp_bandwidth_gbs=1"]
    plan = make_plan(compose(knobs))
    assert plan.reduce_ms == pytest.approx((8.0, 8.0))
    assert make_plan(compose([*knobs[:4]])).reduce_ms is None  # no data parallel, no reduction
    hsdp = make_plan(compose([*knobs, "parallel.dp_shard=2", "data.batch_size=32"]))
    assert hsdp.reduce_ms == pytest.approx((0.5 * 8 + 1.0 * 4,) * 2)  # reduce-scatter 8 MB, all-reduce 4 MB


# ---- the lane --------------------------------------------------------------------------------


def two_stage_rank(text: str = "0F0 1F0 1B0 1W0 0B0 0W0") -> Schedule:
    """One rank holding stages 0 and 1 (1 ms per action): stage 1's last W ends at 4, stage 0's at 6."""
    return Schedule.from_text(f"rank 0: {text}", name="two", placement=Placement.loop(1, 2), num_microbatches=1)


@pytest.mark.parametrize("r1, r0, lane, exposed", [
    (2.0, 0.0, [(1, 4.0, 6.0), (0, 6.0, 6.0)], 0.0),  # the 2 ms drain after 1W0 hides stage 1's reduction
    (1.5, 0.0, [(1, 4.0, 5.5), (0, 6.0, 6.0)], 0.0),
    (3.0, 1.0, [(1, 4.0, 7.0), (0, 7.0, 8.0)], 2.0),  # stage 0 waits for the lane
    (0.5, 2.0, [(1, 4.0, 4.5), (0, 6.0, 8.0)], 2.0),  # the last stage's reduction can never hide
])
def test_lane_exact_arithmetic(r1, r0, lane, exposed):
    sched = add_reduces(two_stage_rank())
    assert [(b, m.stage) for b, m in sched.reduces[0]] == [(4, 1), (6, 0)]
    res = simulate(sched, reduce_ms=(r0, r1))
    assert res.makespan == 6.0 and res.busy_per_rank == (6.0,)
    assert [(sp.stage, sp.start, sp.end) for sp in res.reductions[0]] == lane
    assert res.reduce_exposed_ms == (exposed,)
    assert res.makespan_with_reduce == 6.0 + exposed
    assert res.bubble_fraction_per_rank == (0.0,)  # the bubble stays a compute measure


def test_at_end_exposes_every_reduction():
    sched = add_reduces(two_stage_rank(), at_end=True)
    check_reduces(sched)
    validate(sched)
    assert [(b, m.stage) for b, m in sched.reduces[0]] == [(6, 0), (6, 1)]
    res = simulate(sched, reduce_ms=(1.0, 2.0))
    assert [(sp.stage, sp.start, sp.end) for sp in res.reductions[0]] == [(0, 6.0, 7.0), (1, 7.0, 9.0)]
    assert res.reduce_exposed_ms == (3.0,) and res.makespan_with_reduce == 9.0


def test_a_mark_inside_the_list_waits_for_the_step_before_it():
    # hand-written marks, B taking 2 ms: stage 1's starts when 1W0 ends (5), stage 0's when 0W0 does (8)
    sched = two_stage_rank("0F0 1F0 1B0 1W0 1REDUCE_GRAD 0B0 0W0 0REDUCE_GRAD")
    res = simulate(sched, StageCosts((1.0, 1.0), (2.0, 2.0), (1.0, 1.0)), reduce_ms=(1.0, 1.0))
    assert [(sp.stage, sp.start) for sp in res.reductions[0]] == [(1, 5.0), (0, 8.0)]


def test_no_lane_without_reduce_ms_or_marks():
    sched = add_reduces(two_stage_rank())
    assert simulate(sched).reductions == () and simulate(sched).reduce_exposed_ms == (0.0,)
    plain = simulate(two_stage_rank(), reduce_ms=(5.0, 5.0))
    assert plain.reductions == () and plain.makespan_with_reduce == plain.makespan
    with pytest.raises(ValueError, match="covers 1 stages"):
        simulate(sched, reduce_ms=(1.0,))


@pytest.mark.parametrize("name, P, M, v", [("1f1b", 4, 8, 1), ("zbv", 4, 8, 2), ("dualpipe", 4, 8, 2),
                                           ("interleaved_1f1b", 4, 8, 2)])
def test_overlap_never_loses_and_at_end_exposes_the_sum(name, P, M, v):
    base = registry.build(name, P, M, v)
    costs = StageCosts.uniform(base.placement.num_stages)
    red = tuple(0.5 + 0.25 * s for s in range(base.placement.num_stages))
    over = simulate(add_reduces(base), costs, reduce_ms=red)
    end = simulate(add_reduces(base, at_end=True), costs, reduce_ms=red)
    assert over.makespan == end.makespan == simulate(base, costs).makespan
    for r in range(P):
        assert end.reduce_exposed_ms[r] == pytest.approx(sum(red[s] for s in base.placement.stages_of(r)))
        assert over.reduce_exposed_ms[r] <= end.reduce_exposed_ms[r] + 1e-9
    assert over.makespan_with_reduce <= end.makespan_with_reduce + 1e-9
    if v > 1:  # a rank's earlier-finished stage reduces during its drain
        assert over.makespan_with_reduce < end.makespan_with_reduce


def test_overlap_reduce_false_from_the_config(compose):
    knobs = ["mode=simulate", "model=sleep", "schedule=zbv", "parallel.dp_replicate=2"]
    plan = make_plan(compose([*knobs, "parallel.overlap_reduce=false"]))
    for r in range(2):
        end = len(list(plan.schedule.actions(r)))
        assert {b for b, _ in plan.schedule.reduces[r]} == {end}
    assert make_plan(compose(knobs)).schedule.reduces != plan.schedule.reduces


# ---- drawn and recorded ---------------------------------------------------------------------


def dp_result():
    sched = add_reduces(registry.build("zbv", 2, 4, 2))
    return simulate(sched, StageCosts.uniform(4), reduce_ms=(3.0, 3.0, 3.0, 3.0))


def test_timeline_draws_a_dp_lane_under_each_rank():
    res = dp_result()
    text = [line.plain for line in timeline_lines(res, 120)]
    ranks = [i for i, line in enumerate(text) if line.lstrip().startswith("rank ")]
    assert len(ranks) == 2 and all(text[i + 1].lstrip().startswith("dp │") for i in ranks)
    lanes = "\n".join(text[i + 1] for i in ranks)
    assert all(f"R{s}" in lanes for s in range(4))
    assert "reduction (dp row)" in "\n".join(text) and "with reduce" in "\n".join(text)
    plain = [line.plain for line in timeline_lines(simulate(registry.build("zbv", 2, 4, 2)), 120)]
    assert not any(line.lstrip().startswith("dp │") for line in plain)


def test_record_summary_and_trace_carry_the_reduction():
    res = dp_result()
    rec = result_record(res, schedule_name="zbv", analytic_bubble=None, param_copies=1, virtual_stages=2)
    assert rec["reduce_exposed_ms_per_rank"] == list(res.reduce_exposed_ms)
    assert rec["reduce_exposed_ms_max"] == max(res.reduce_exposed_ms) > 0
    assert rec["makespan_with_reduce"] == res.makespan_with_reduce > rec["makespan"]
    table = summary_table([{**rec, "schedule": "interleaved_1f1b"}])  # the longest name
    assert table.columns[-1].header == "step ms\n+reduce"
    narrow = Console(record=True, width=80, file=io.StringIO())
    narrow.print(table)
    assert "…" not in narrow.export_text()
    events = json.loads(json.dumps(chrome_trace(res)))["traceEvents"]
    reduces = [e for e in events if e.get("cat") == "reduce"]
    assert sorted((e["tid"], e["name"]) for e in reduces) == [(2, "0REDUCE_GRAD"), (2, "3REDUCE_GRAD"),
                                                              (3, "1REDUCE_GRAD"), (3, "2REDUCE_GRAD")]
    assert all(e["dur"] == 3000.0 for e in reduces)
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    assert sorted(order, key=order.get) == [0, 2, 1, 3]  # each rank's reductions right under it


def test_measured_reduce_beside_the_simulated():
    res = dp_result()
    samples = samples_from_sim(res)
    for s, lane, exposed in zip(samples, res.reductions, res.reduce_exposed_ms):
        s.reduce_issued_ms = {sp.stage: sp.start for sp in lane}
        s.reduce_done_ms = {sp.stage: sp.end for sp in lane}
        s.reduce_exposed_ms = exposed
        s.step_ms = res.makespan_with_reduce
    m = measure_step(2, res.schedule, samples, reduce_ms=(3.0,) * 4)
    rec = m.record()
    n = len(res.reduce_exposed_ms)
    assert [rec[f"pipeline/reduce_exposed_ms/rank{r}"] for r in range(n)] == pytest.approx(list(res.reduce_exposed_ms))
    assert [rec[f"pipeline/reduce_exposed_simulated_ms/rank{r}"] for r in range(n)] == pytest.approx(
        list(res.reduce_exposed_ms))
    assert rec["pipeline/makespan_with_reduce_ms"] == pytest.approx(res.makespan_with_reduce)
    assert rec["pipeline/makespan_with_reduce_simulated_ms"] == pytest.approx(res.makespan_with_reduce)
    assert m.measured.reductions == res.reductions
    most = max(res.reduce_exposed_ms)
    line = metrics_line({"step": 2, "train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 1.0,
                         "perf/tokens_per_s": 1.0, "perf/step_time_s": 1.0, **rec}, 4, None)
    assert f"| reduce {most:.0f}ms (sim {most:.0f}ms)" in line
    assert rank_table(m).columns[-1].header == "reduce\nms/sim"
    trace = measured_trace(m)
    assert ({e["name"] for e in trace["traceEvents"] if e.get("cat") == "reduce"}
            == {f"{s}REDUCE_GRAD" for s in range(4)})
    plain = simulate(registry.build("zbv", 2, 4, 2))
    assert "pipeline/reduce_exposed_ms/rank0" not in measure_step(2, plain.schedule, samples_from_sim(plain)).record()
