"""Expert parallel in the cost model, mode=simulate and the planner (issue #28), and the simulator's F&B
overlap model for MoE stages (issue #29, design note C4.8). Pure: no processes."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json

import pytest
from rich.console import Console

from pipetrain.compose import compose_config
from pipetrain.partition.costs import LayerCost, ep_layer_costs
from pipetrain.execution import overlaps
from pipetrain.plan import layer_costs, layout_inputs, make_partition, make_plan, simulate_layout
from pipetrain.planner.cmd import PLAN_FILE, make_rows, run_plan
from pipetrain.schedules.fb_pairs import LayerNodes, PassNodes, pair_saving
from pipetrain.schedules.ir import Action, Op, Overlap
from pipetrain.schedules.simulate import StageCosts
from pipetrain.simulate_cmd import plan_and_simulate

pytestmark = pytest.mark.pure

SIM = ["mode=simulate", "model=moe-tiny", "data.seq_len=64", "data.batch_size=8", "pipeline.degree=2",
       "pipeline.microbatches=4", "parallel.dp_shard=2", "schedule=dualpipev"]


def test_all_to_all_bytes_and_experts_per_rank_match_a_hand_count():
    """moe-tiny (hidden 128, top-2 of 8 experts of width 128), 2 x 64 tokens per microbatch, fp32, ep=2:
    dispatch and combine each send 128 tokens x 2 copies x 128 values x 4 B, half of them off the rank,
    in F and again in B; each rank stores 4 of the 8 experts (3 x 128 x 128 each)."""
    ep1, ep2 = (layer_costs(compose_config([*SIM, "data.batch_size=16", f"parallel.ep={e}",
                                            "cluster.ep_bandwidth_gbs=2"])) for e in (1, 2))
    sent = 2 * (128 * 2 * 128 * 4) / 2  # dispatch + combine, (ep-1)/ep of it remote
    ms = sent / 2e9 * 1e3
    for one, two in zip(ep1[1:-1], ep2[1:-1]):  # every block is MoE
        assert two.comm_f_ms == pytest.approx(ms) and two.comm_b_ms == pytest.approx(ms)
        assert (two.f_ms, two.b_ms, two.w_ms) == pytest.approx((one.f_ms + ms, one.b_ms + ms, one.w_ms))
        assert one.experts_params == 8 * 3 * 128 * 128 and two.experts_params == 4 * 3 * 128 * 128
        assert one.params - two.params == 4 * 3 * 128 * 128
        assert two.flops_per_token == one.flops_per_token, "MFU counts the same active FLOPs at any ep"
        # the experts node's share: top-2 routed experts, 2 FLOPs per weight, of the block's forward FLOPs
        share = 2 * 2 * 3 * 128 * 128 / one.flops_per_token
        assert two.experts_flops_share == one.experts_flops_share == pytest.approx(share)
    assert ep1[0] == ep2[0] and ep1[-1] == ep2[-1], "embedding and head have no all-to-all"


def test_simulated_step_grows_as_the_ep_bandwidth_shrinks(tmp_path):
    steps = [make_plan(compose_config([*SIM, "parallel.ep=2", f"cluster.ep_bandwidth_gbs={gbs}"]))
             .simulated.result.makespan_with_reduce for gbs in (100, 1, 0.1)]
    assert steps[0] < steps[1] < steps[2], steps
    assert make_plan(compose_config([*SIM, "cluster.ep_bandwidth_gbs=0.1"])).simulated.result.makespan_with_reduce \
        < steps[2], "ep=1 sends nothing"
    plan, record = plan_and_simulate(compose_config([*SIM, "parallel.ep=2"]), tmp_path, Console(file=io.StringIO()),
                                     timeline=False, write=False)
    a2a = sum(l.comm_f_ms for l in plan.layer_costs)  # simulate.json says what the stage costs include
    assert (record["expert_parallel"]["ep"] == 2
            and record["expert_parallel"]["a2a_f_ms"] == pytest.approx(a2a, rel=1e-3))


def test_a_rank_dispatches_its_own_tokens_under_context_parallel():
    """Experts folded over cp (issue #48): a cp rank holds 1/cp of the microbatch's tokens, so its all-to-alls
    carry half the bytes at cp=2, and its experts still 1/ep of them."""
    def a2a(cp: int) -> list[float]:
        ep1, ep2 = (layer_costs(compose_config([*SIM, "data.batch_size=16", f"parallel.cp={cp}", f"parallel.ep={e}",
                                                "cluster.ep_bandwidth_gbs=2"])) for e in (1, 2))
        assert all(two.experts_params == 4 * 3 * 128 * 128 for two in ep2[1:-1])
        return [two.comm_f_ms - one.comm_f_ms for one, two in zip(ep1[1:-1], ep2[1:-1])]

    whole = 2 * (128 * 2 * 128 * 4) / 2 / 2e9 * 1e3  # as the hand count above, 128 tokens
    assert a2a(1) == pytest.approx([whole] * 8) and a2a(2) == pytest.approx([whole / 2] * 8)


def test_plan_rows_fold_ep_over_dp_and_cp(tmp_path):
    """plan.cp with an MoE model: ep borrows dp x cp, so a 4-rank plan at cp=2 lists ep=2 at dp=1 (ep over cp) and
    ep=4 at dp=2; every row's ep divides dp x cp."""
    cfg = compose_config(["mode=plan", "model=moe-tiny", "data.seq_len=64", "data.batch_size=8", "plan.world_size=4",
                          "plan.schedules=[1f1b]", "plan.microbatch_sizes=[1]", "plan.prune=false", "plan.cp=[1,2]",
                          "plan.ep=[1,2,4]"])
    run_plan(cfg, tmp_path)
    rows = json.loads((tmp_path / PLAN_FILE).read_text())["rows"]
    combos = {(r["pp"], r["dp"], r["cp"], r["ep"]) for r in rows}
    assert {(2, 1, 2, 2), (1, 2, 2, 4), (1, 1, 4, 4)} & combos == {(2, 1, 2, 2), (1, 2, 2, 4)}  # plan.cp has no 4
    assert all((r["dp"] * r["cp"]) % r["ep"] == 0 for r in rows)
    assert "pp2 x dp1 (ep2) x cp2" in {r["layout"] for r in rows}


def test_plan_rows_carry_ep_in_the_table_and_json(tmp_path):
    cfg = compose_config(["mode=plan", "model=moe-tiny", "data.seq_len=64", "data.batch_size=8", "plan.world_size=4",
                          "plan.schedules=[1f1b]", "plan.microbatch_sizes=[1]", "plan.prune=false", "plan.pp=[2]"])
    run_plan(cfg, tmp_path)
    rows = json.loads((tmp_path / PLAN_FILE).read_text())["rows"]
    assert {(r["dp"], r["ep"], r["dp_shard"]) for r in rows} == {(2, 1, False), (2, 2, True)}
    assert "pp2 x dp2 (ep2) (fsdp)" in {r["layout"] for r in rows}
    assert "ep" in (tmp_path / "plan.csv").read_text().splitlines()[0].split(",")
    by_ep = {r["ep"]: r for r in rows}  # FSDP2 over the expert-data-parallel ranks: states as ep=1's sharded
    assert by_ep[2]["memory_per_rank"][0]["states_gb"] < by_ep[1]["memory_per_rank"][0]["states_gb"]


@pytest.mark.parametrize("extra, message", [
    (["plan.ep=[3]"], "plan.ep lists 3, which does not divide model.moe.num_experts=8"),
    (["model=llama-tiny", "plan.ep=[2]"], "plan.ep lists 2 but model=llama-tiny has no MoE experts"),
    (["plan.ep=[0]"], "plan.ep must list expert-parallel degrees >= 1"),
])
def test_bad_plan_ep_fails_in_one_line(extra, message):
    with pytest.raises(ValueError, match=message) as err:
        make_rows(compose_config(["mode=plan", "model=moe-tiny", "data.seq_len=64", "plan.world_size=4", *extra]))
    assert "\n" not in str(err.value)


def test_fb_pair_hides_part_of_its_all_to_all_and_never_more():
    """Per MoE layer pair (fb_pairs.pair_saving, the executor's node chain): what the pair saves over its serial
    time is >= 0 and at most the four all-to-all times (on one link: at most the smaller of compute and
    all-to-all), over a grid of compute and all-to-all times; a stage with two forward layers against one
    backward layer saves one layer pair's worth (the second runs alone); costs without layers keep the
    scalar sim.fb_overlap."""
    for a2a, attn, experts, w in itertools.product((0.5, 2.0, 5.0, 20.0), (0.5, 4.0), (0.5, 3.0), (0.0, 6.0)):
        one = PassNodes(attn, a2a, experts, a2a, 0.1)
        layer = LayerNodes(one, one, w)
        saved = [pair_saving(layer, layer, with_w=with_w) for with_w in (False, True)]
        assert all(0.0 <= x <= 4 * a2a + 1e-12 for x in saved), (a2a, attn, experts, w, saved)
        assert w or saved[0] == saved[1], "with no W, BW and B pairs cost the same"
        # on one link the all-to-alls queue: the pair costs at least max(compute, all-to-all) (issue #29's bound)
        linked = pair_saving(layer, layer, with_w=False, one_link=True)
        assert 0.0 <= linked <= min(2 * (attn + experts + 0.1), 4 * a2a) + 1e-12 and linked <= saved[0] + 1e-12
    layer = LayerNodes(PassNodes(2.0, 1.0, 1.0, 1.0, 0.0), PassNodes(2.0, 1.0, 1.0, 1.0, 0.0), 1.0)
    two = StageCosts((10.0, 5.0), (10.0, 5.0), (2.0, 1.0), layers=((layer, layer), (layer,)))
    pair = Overlap(Action(Op.F, 0, 1), Action(Op.BW, 1, 0))
    saved = pair_saving(layer, layer, with_w=True)
    assert saved > 0 and two.step(pair) == pytest.approx(10.0 + (5.0 + 1.0) - saved)
    assert StageCosts((10.0,), (10.0,), (2.0,)).step(Overlap(Action(Op.F, 0, 1), Action(Op.BW, 0, 0)),
                                                     fb_overlap=0.5) == pytest.approx(11.0), "no layers: the scalar"


def test_fb_overlap_hides_all_to_all_in_the_simulated_dualpipev_step():
    """The same layout with and without the per-layer model: overlap shortens the F&B pairs of MoE stages, by no
    more than their all-to-all time, and a dense model's costs carry no per-layer model."""
    cfg = compose_config([*SIM, "parallel.ep=2", "cluster.ep_bandwidth_gbs=0.5"])
    part = make_partition(cfg, layer_costs(cfg), 4)
    base = layout_inputs(cfg, part, 4)
    serial, overlapped = (simulate_layout(dataclasses.replace(base, overlap_layers=on)) for on in (False, True))
    assert not serial.stage_costs.layers and len(overlapped.stage_costs.layers) == 4
    assert overlapped.stage_costs.one_link, "analytic all-to-all times are bytes over one link's bandwidth"
    a2a = sum(l.comm_f_ms + l.comm_b_ms for l in part.layers) * cfg.pipeline.microbatches
    assert serial.result.makespan - a2a < overlapped.result.makespan < serial.result.makespan
    # pipeline.fb_overlap as the run applies it: on prices the overlap, auto too (FSDP2 stages run node by node
    # as well: the reducer gathers their parameters) unless GPU streams share one hardware queue; off is serial
    asked = {m: make_plan(compose_config([*SIM, "parallel.ep=2", f"pipeline.fb_overlap={m}"])).stage_costs.layers
             for m in ("off", "auto", "on")}
    assert (bool(asked["off"]), bool(asked["auto"]), bool(asked["on"])) == (False, True, True)
    assert overlaps("auto", recompute=False) and not overlaps("auto", recompute=False, one_queue=True)
    assert overlaps("on", recompute=False, one_queue=True) and not overlaps("on", recompute=True)
    dense = compose_config(["mode=simulate", "model=llama-tiny", "pipeline.degree=2", "schedule=dualpipev"])
    dense_part = make_partition(dense, layer_costs(dense), 4)
    dense_in = dataclasses.replace(layout_inputs(dense, dense_part, 4), overlap_layers=True)
    assert simulate_layout(dense_in).stage_costs.layers == ()


def test_ep_one_costs_are_the_whole_models():
    layer = LayerCost("moe", 1.0, 1.0, 1.0, params=10, experts_params=8, a2a_values_per_token=4)
    assert ep_layer_costs([layer], ep=1, tokens=4, bytes_per_value=4, bandwidth_gbs=1.0) == [layer]
    with pytest.raises(ValueError, match="cluster.ep_bandwidth_gbs must be > 0"):
        ep_layer_costs([layer], ep=2, tokens=4, bytes_per_value=4, bandwidth_gbs=0.0)
    for knob in ("ep", "cp"):
        with pytest.raises(ValueError, match=f"cluster.{knob}_bandwidth_gbs must be > 0 GB/s"):
            compose_config([*SIM, f"cluster.{knob}_bandwidth_gbs=0"])
