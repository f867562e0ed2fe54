"""One path from a layout to a simulated schedule (plan.simulate_layout): the planner's row for a layout
and make_plan's plan of the config that trains the row (planner/cmd.py apply_row) are the same
schedule, the same stage costs and the same simulation, so the same makespan, bubble and peak memory;
compiled and recomputing stages included, and zb_auto, which each searches for its own costs."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pipetrain.compose import compose_config
from pipetrain.plan import make_plan, simulate_layout
from pipetrain.planner.cmd import apply_row, device, make_rows, workload
from pipetrain.planner.memory import peak_activation_bytes
from pipetrain.planner.search import _Evaluator
from pipetrain.schedules import registry
from pipetrain.schedules.simulate import simulate

pytestmark = pytest.mark.pure

# the planner's p2p: plan.p2p_latency_ms (null: the run's sim.comm_ms) + the boundary's bytes at 10^9 GB/s
# (1e-10 ms; the run's simulation prices none): the only input the two differ in
SLEEP = ["mode=plan", "model=sleep", "model.layers=8", "model.params_per_layer=1000000", "plan.world_size=4",
         "data.batch_size=32", "plan.p2p_gbs=1e9", "plan.prune=false", "plan.memory_gb=1", "sim.comm_ms=0.5",
         "plan.schedules=[1f1b,zbh1,zbv,zb_auto,dualpipev]", "model.f_ms=3", "model.b_ms=2.5", "model.w_ms=1.5"]


@pytest.mark.parametrize("extra", [
    ["trainer.compile=true"],
    ["plan.recompute=[true]", "plan.recompute_partial=true"],
    ["trainer.compile=true", "plan.recompute=[true]", "plan.dp_shard=true"],
], ids=["compiled", "recompute", "compiled+recompute+fsdp"])
def test_a_planner_row_is_make_plans_simulation_of_its_config(extra):
    checked = rows_equal_make_plan(compose_config([*SLEEP, *extra]))
    assert {c.schedule for c in checked} == {"1f1b", "zbh1", "zbv", "zb_auto", "dualpipev"}, checked


# expert parallel (moe-tiny: all-to-alls in F and B, experts / ep) and context parallel (llama-tiny: 1/cp of
# the sequence, the K/V exchanges): rows that carry ep and cp are make_plan's simulation of their configs too
MOE = ["mode=plan", "model=moe-tiny", "data.seq_len=64", "data.batch_size=8", "plan.world_size=4", "plan.p2p_gbs=1e9",
       "plan.prune=false", "plan.memory_gb=1", "sim.comm_ms=0.5", "plan.schedules=[1f1b,dualpipev]",
       "plan.microbatch_sizes=[1]", "plan.pp=[2]", "cluster.ep_bandwidth_gbs=0.5"]
CP = ["mode=plan", "model=llama-tiny", "data.seq_len=64", "data.batch_size=8", "plan.world_size=4",
      "plan.p2p_gbs=1e9", "plan.prune=false", "plan.memory_gb=1", "sim.comm_ms=0.5", "plan.schedules=[1f1b,zbv]",
      "plan.microbatch_sizes=[1]", "plan.pp=[2]", "plan.cp=[1,2]", "cluster.cp_bandwidth_gbs=1"]


def test_selective_recompute_rows_are_make_plans_simulation_of_their_configs():
    """trainer.recompute=selective rows (plan.recompute_selective): B pays the modules' recompute, the stages
    keep their layers' selective bytes; the row's config plans the same."""
    cfg = compose_config([*CP, "plan.cp=[1]", "plan.recompute=[true]", "plan.recompute_selective=true",
                          "plan.recompute_partial=true"])
    checked = rows_equal_make_plan(cfg)
    assert {c.recompute_mode for c in checked} == {"full", "selective"}, checked


@pytest.mark.parametrize("overrides, knob", [(MOE, "ep"), ([*MOE, "pipeline.fb_overlap=on"], "ep"), (CP, "cp"),
                                              ([*CP, "parallel.cp_rotate=ring"], "cp")],
                         ids=["ep", "ep-fb-overlap", "cp", "cp-ring"])
def test_rows_with_ep_or_cp_are_make_plans_simulation_of_their_configs(overrides, knob):
    checked = rows_equal_make_plan(compose_config(overrides))
    assert {getattr(c, knob) for c in checked} == {1, 2}, checked


def rows_equal_make_plan(cfg):
    """Every feasible row with pp > 1 against make_plan of the config apply_row makes of it; the rows checked."""
    rows, _ = make_rows(cfg)
    ev = _Evaluator(workload(cfg), device(cfg))
    checked = set()
    for row in rows:
        c = row.candidate
        if not row.feasible or c.pp == 1:
            continue
        plan = make_plan(dataclasses.replace(apply_row(cfg, row), mode=cfg.mode))
        sim = simulate(plan.schedule, plan.stage_costs, comm_ms=cfg.sim.comm_ms, check=False, reduce_ms=plan.reduce_ms)
        # the planner's own SimulatedPlan of the row's layout: the same schedule, costs and reductions
        pl = registry.placement_for(c.schedule, c.pp, c.v)
        part, recompute = ev.cut(c), c.recompute_stages(pl)
        laid = simulate_layout(ev.layout_inputs(c, part, recompute, row.budgets))
        assert laid.schedule.to_csv() == plan.schedule.to_csv(), c
        assert laid.stage_costs == plan.stage_costs and laid.reduce_ms == plan.reduce_ms, c
        assert (plan.recompute_stages, plan.compiled_stages) == (recompute, frozenset(range(pl.num_stages))
                                                                if cfg.trainer.compile else frozenset())
        assert row.pred_step_ms == pytest.approx(sim.makespan_with_reduce, rel=1e-9), c
        assert row.bubble == pytest.approx(sim.bubble_fraction_mean, rel=1e-9), c
        assert laid.result.peak_activations_per_rank == sim.peak_activations_per_rank, c
        # the row's peak memory, read off make_plan's simulated timeline with the planner's own memory model
        mem = ev.memory_model(c, pl, part, recompute)
        keep = dict(enumerate(laid.w_keep))
        for r, rank in enumerate(row.memory):
            assert rank.activations == peak_activation_bytes(sim.timeline[r], mem.stage_bytes, keep), (c, r)
        checked.add(c)
    return checked


def test_a_plan_carries_its_simulation_and_ships_without_it():
    """make_plan keeps simulate_layout's value: its simulation is what mode=simulate's call of the
    simulator gives, and a pickled plan (rank 0's, broadcast to the ranks) leaves it behind."""
    cfg = compose_config(["mode=simulate", "model=sleep", "model.layers=8", "pipeline.degree=4", "schedule=zbv",
                          "sim.comm_ms=0.3", "sim.fb_overlap=0.2", "trainer.compile=true", "parallel.dp_replicate=2"])
    plan = make_plan(cfg)
    sim = simulate(plan.schedule, plan.stage_costs, comm_ms=0.3, fb_overlap=0.2, check=False, reduce_ms=plan.reduce_ms)
    assert plan.simulated.result.makespan_with_reduce == sim.makespan_with_reduce
    assert plan.simulated.result.timeline == sim.timeline
    shipped = pickle.loads(pickle.dumps(plan))
    assert "result" not in shipped.simulated.__dict__ and shipped == plan
    assert shipped.simulated.result.makespan_with_reduce == sim.makespan_with_reduce
