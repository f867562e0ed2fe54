"""mode=plan: the ranked table, plan.json and plan.csv; what a row predicts is what mode=simulate
simulates for the config the row trains; infeasible rows say by how much; bad input fails in one line."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import time

import pytest

from pipetrain.compose import compose_config
from pipetrain.plan import make_plan
from pipetrain.planner.cmd import PLAN_CSV, PLAN_FILE, apply_row, make_rows, run_plan
from pipetrain.planner.space import candidates
from pipetrain.partition.strategies import partition
from pipetrain.schedules.ir import Op
from pipetrain.schedules.simulate import simulate

pytestmark = pytest.mark.pure

SLEEP = ["mode=plan", "model=sleep", "model.layers=8", "model.params_per_layer=1000000", "plan.world_size=4",
         "data.batch_size=32", "plan.p2p_gbs=1000000", "plan.prune=false"]


def test_plan_writes_ranked_rows_with_the_public_fields(tmp_path):
    cfg = compose_config([*SLEEP, "plan.memory_gb=0.06"])
    out = run_plan(cfg, tmp_path)
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    rows = doc["rows"]
    assert doc["world_size"] == 4 and doc["global_batch"] == 32 and len(rows) == out["candidates"] > 20
    for r in rows:
        assert {"schedule", "pp", "dp", "microbatches", "pred_step_ms", "pred_peak_gb", "feasible"} <= set(r)
        assert r["pp"] * r["dp"] == 4 and r["dp"] * r["microbatches"] * r["microbatch_size"] == 32
    feas = [r["feasible"] for r in rows]
    assert True in feas and False in feas, "the cap rules some rows out"
    assert feas == sorted(feas, reverse=True), "feasible rows first"
    ok = [r for r in rows if r["feasible"]]
    assert [r["tokens_per_s"] for r in ok] == sorted((r["tokens_per_s"] for r in ok), reverse=True)
    assert all(r["pred_peak_gb"] <= 0.06 for r in ok)
    for r in rows:
        if not r["feasible"]:
            m = re.match(r"^OOM on rank (\d+) by ([\d.]+) GB", r["reason"])
            assert m, r["reason"]
            over = float(m.group(2))
            assert r["pred_peak_gb"] - 0.06 == pytest.approx(over, abs=0.051)
    with open(tmp_path / PLAN_CSV) as fh:
        table = list(csv.DictReader(fh))
    assert [t["schedule"] for t in table] == [r["schedule"] for r in rows]
    assert table[0]["pred_step_ms"] == str(rows[0]["pred_step_ms"])


@pytest.mark.parametrize("compiled,recompute", [(False, "false"), (True, "false"), (False, "true"), (True, "true"),
                                                (False, "partial")])
def test_a_row_predicts_what_its_config_simulates(compiled, recompute):
    """The best rows, turned into configs (apply_row), simulate to the planner's step time; under
    trainer.compile both keep B and W apart (as eager stages: issue 49), and under recompute both run
    the forward again in B and in a W apart (StageCosts.with_recompute), on
    every stage or (plan.recompute_partial) on the first ranks' stages (trainer.recompute_stages)."""
    partial = recompute == "partial"
    cfg = compose_config([*SLEEP, "plan.memory_gb=1", "sim.comm_ms=0.5", "plan.schedules=[1f1b,zbh1,zbv,zb_auto]",
                          f"trainer.compile={str(compiled).lower()}",
                          f"plan.recompute=[{'true' if partial else recompute}]",
                          f"plan.recompute_partial={str(partial).lower()}"])
    rows, _ = make_rows(cfg)
    assert any(r.candidate.schedule != "1f1b" for r in rows[:6])
    assert all(r.candidate.recompute is (recompute != "false") for r in rows)
    if partial:  # the first ranks recompute, the last not: faster than all of them (the sleep model's memory is small)
        piped = [r.candidate for r in rows[:8] if r.candidate.pp > 1]
        assert piped and all(c.recompute_ranks is not None for c in piped), piped
    for row in rows[:6]:
        run_cfg = apply_row(cfg, row)
        plan = make_plan(dataclasses.replace(run_cfg, mode=cfg.mode))
        sim = simulate(plan.schedule, plan.stage_costs, comm_ms=run_cfg.sim.comm_ms, reduce_ms=plan.reduce_ms)
        assert sim.makespan_with_reduce == pytest.approx(row.pred_step_ms, rel=1e-6), row.to_json()
        assert run_cfg.layout.world == 4 and run_cfg.data.batch_size == 32


@pytest.mark.parametrize("schedules,at_pp1", [
    (["gpipe", "zbv", "1f1b", "zbh1"], ["1f1b"]),  # one rank: gradient accumulation, 1F1B's memory
    (["zbv", "gpipe", "zbh2"], ["zbh2"]),  # a one-stage schedule that keeps fewer than gpipe's M
    (["zbv", "gpipe"], ["gpipe"]),  # the only one-stage schedule listed
    (["zbv", "dualpipev"], ["zbv", "dualpipev"]),  # nothing else listed: kept as asked
])
def test_pp1_is_one_row_per_microbatching_not_one_per_schedule(schedules, at_pp1):
    """On one pipeline rank every schedule runs the same M microbatches back to back: a row per
    schedule (8 identical step times on the quickstart's pp1 x dp2, interleaved_1f1b's ranked first)
    told the user nothing and let a two-stage-per-rank order win a tie."""
    cands = candidates(world=2, global_batch=16, num_layers=8, schedules=schedules, microbatch_sizes=[1, 2],
                       virtual_stages=[2])
    assert sorted({c.schedule for c in cands if c.pp == 1}) == sorted(at_pp1)
    assert {c.schedule for c in cands if c.pp == 2} == set(schedules)
    assert len([c for c in cands if c.pp == 1 and c.schedule == at_pp1[0]]) == 2  # M = 8 and 16 at dp 2


def test_a_small_models_oom_says_by_how_much(tmp_path):
    """plan.memory_gb under the sleep model's 0.2 MB per rank: the reason keeps two digits of the
    overshoot (a tenth of a GB printed every one as 'by 0.0 GB')."""
    run_plan(compose_config([*SLEEP, "model.params_per_layer=1000", "plan.memory_gb=0.0002"]), tmp_path)
    rows = json.loads((tmp_path / PLAN_FILE).read_text())["rows"]
    simulated = [r for r in rows if not r["feasible"] and " by " in r["reason"] and "(weights" not in r["reason"]]
    assert simulated
    for r in simulated:
        over = float(re.match(r"^OOM on rank \d+ by ([\d.]+) GB$", r["reason"]).group(1))
        assert over > 0 and over == pytest.approx(r["pred_peak_gb"] - 0.0002, rel=0.06), r
    assert any(re.match(r"^OOM on rank \d+ by 0\.0*[1-9]\d GB \(weights", r["reason"]) for r in rows)


def test_a_few_hundred_candidates_in_under_a_minute():
    cfg = compose_config(["mode=plan", "model=gpt2", "plan.world_size=8", "plan.memory_gb=4", "data.batch_size=64",
                          "data.seq_len=512", "plan.virtual_stages=[2,4]", "plan.recompute=[false,true]"])
    start = time.perf_counter()
    rows, meta = make_rows(cfg)
    assert meta["candidates"] >= 200
    assert time.perf_counter() - start < 60
    assert rows[0].feasible and any(not r.feasible for r in rows)


@pytest.mark.parametrize("override,knob", [
    ("plan.objective=speed", "plan.objective"),
    ("plan.memory_gb=0", "plan.memory_gb"),
    ("plan.microbatch_sizes=[0]", "plan.microbatch_sizes"),
    ("plan.global_batch=3 plan.pp=[1]", "plan.global_batch"),  # dp = 4 does not divide 3
    ("plan.calibrate_steps=1", "plan.calibrate_steps"),
])
def test_bad_plan_input_names_the_knob(override, knob):
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")) as err:
        make_rows(compose_config([*SLEEP, *override.split()]))
    assert "\n" not in str(err.value)


def test_calibration_defaults_on_only_where_the_run_is_this_machines():
    """plan.calibrate=null: on for schedule=auto training on local CPU ranks; off for mode=plan
    (it may plan another cluster), mode=simulate (no process) and ranks started by torchrun; an
    explicit value wins.
    Where it cannot run, one line says what to set, before any rank starts."""
    from pipetrain.planner.cmd import calibrating
    from pipetrain.planner.measure import check

    auto = ["schedule=auto", "trainer.device=cpu"]
    assert calibrating(compose_config(auto))
    assert not calibrating(compose_config([*auto, "plan.calibrate=false"]))
    assert not calibrating(compose_config([*auto, "cluster=torchrun"]))
    assert not calibrating(compose_config([*auto, "mode=simulate"]))
    assert not calibrating(compose_config(SLEEP)) and calibrating(compose_config([*SLEEP, "plan.calibrate=true"]))
    with pytest.raises(ValueError, match=r"plan\.world_size or plan\.calibrate=false") as err:
        check(compose_config([*SLEEP, "plan.calibrate=true"]), 3)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cluster=local"):
        check(compose_config([*auto, "cluster=torchrun"]), 2)


def _sleep_plan(schedule, *extra):
    return make_plan(compose_config(["mode=simulate", "model=sleep", "model.layers=4", "model.f_ms=10", "model.b_ms=10",
                                     "model.w_ms=10", f"schedule={schedule}", "pipeline.degree=2",
                                     "pipeline.microbatches=4", "trainer.activation_checkpointing=true", *extra]))


def test_recompute_costs_what_the_executor_measured():
    """trainer.activation_checkpointing, sleep model (2 layers of f = b = w = 10 ms per stage), measured per
    action on 2 gloo ranks: zbh1 F 21, B 42, W 42 ms (non-reentrant checkpointing recomputes for W's
    pass too), step 464 ms; 1f1b F 21, BW 62 ms (one pass, one recompute), step 418 ms. Before, every
    simulation (mode=simulate, the run's up-front check) costed 260 ms for zbh1 as if nothing recomputed."""
    zb, ofob = _sleep_plan("zbh1"), _sleep_plan("1f1b")
    assert (zb.stage_costs.b, zb.stage_costs.w) == ((40.0, 40.0), (40.0, 40.0))
    assert (ofob.stage_costs.b, ofob.stage_costs.w) == ((40.0, 40.0), (20.0, 20.0))
    assert simulate(zb.schedule, zb.stage_costs).makespan == pytest.approx(440.0)
    assert simulate(ofob.schedule, ofob.stage_costs).makespan == pytest.approx(400.0)
    mixed = _sleep_plan("dualpipev")  # B and W apart, and BW: one backward pass, one recompute
    bw = next(a for row in mixed.schedule.steps for step in row for a in step.parts() if a.op is Op.BW)
    assert (mixed.stage_costs.action(bw), mixed.stage_costs.b[bw.stage], mixed.stage_costs.w[bw.stage]) == (30, 20, 20)
    compiled = _sleep_plan("zbh1", "trainer.compile=true")  # B and W apart under compile too (issue 49)
    assert compiled.stage_costs == zb.stage_costs


def test_recompute_memory_keeps_each_layers_input_and_one_layer_recomputing():
    """Per-layer checkpointing keeps each layer's input (token ids into the embedding: 8 bytes a token;
    a boundary tensor into every other layer) for every microbatch in flight, and while a backward
    recomputes a layer, that layer's activations: what the executor counts (263,168 bytes kept by
    GPT-2 tiny's embedding and 4 blocks at 2 x 64 tokens, measured with its SavedBytes hooks)."""
    from pipetrain.planner.cmd import workload

    cfg = compose_config(["mode=plan", "model=gpt2-tiny", "plan.world_size=2", "plan.pp=[2]", "plan.schedules=[1f1b]",
                          "plan.microbatch_sizes=[2]", "plan.recompute=[false,true]", "plan.prune=false",
                          "plan.recompute_partial=true", "data.batch_size=16", "data.seq_len=64", "plan.memory_gb=1",
                          "plan.margin=0"])
    rows, _ = make_rows(cfg)
    by = {r.candidate.recompute_label: r for r in rows if r.candidate.pp == 2}
    assert set(by) == {"no", "yes", "rank 0"}
    by[True], by[False] = by["yes"], by["no"]
    layers = workload(cfg).layers(2)
    tokens, hidden = 2 * 64, cfg.model.n_embd
    keep, full = by[True].memory[0], by[False].memory[0]
    bounds = partition(layers, 2, by[True].candidate.partition).bounds
    assert bounds[0] == range(0, 5)  # the embedding and 4 blocks, as measured
    assert keep.activations == pytest.approx(2 * (8 * tokens + 4 * hidden * 4 * tokens))  # 2 in flight on rank 0
    assert keep.activations == pytest.approx(2 * 263_168)
    assert keep.recompute == pytest.approx(max(layers[i].activation_bytes_per_token for i in bounds[0]) * tokens)
    assert full.recompute == 0 and keep.states == full.states
    # under bf16 the stage tensors are bf16, but the first stage's residual stream stays fp32 (measured with
    # autocast: stage 0 keeps 263,168 bytes as in fp32; stage 1, 5 layers from a bf16 input: 163,840), and
    # the last stage keeps the loss's log-softmax (fp32 under autocast) and targets: outside the
    # checkpointed layers, so recompute does not drop them (gpipe's last rank measured 12% over the plan)
    bf16 = {r.candidate.recompute_label: r for r in make_rows(dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, precision="bf16")))[0] if r.candidate.pp == 2}["yes"]
    bounds16 = partition(layers, 2, bf16.candidate.partition).bounds
    assert bf16.memory[0].activations == pytest.approx(2 * 263_168)
    loss = (cfg.model.vocab_size * 4 + 8) * tokens  # log-probabilities and int64 targets
    # 1 in flight
    assert bf16.memory[1].activations == pytest.approx(len(bounds16[1]) * hidden * 2 * tokens + loss, rel=1e-3)
    assert keep.total < full.total
    # rank 0 alone recomputing: its memory is the all-recompute row's, rank 1's the plain row's
    some = by["rank 0"].memory
    assert (some[0].activations, some[0].recompute) == (keep.activations, keep.recompute)
    assert (some[1].activations, some[1].recompute) == (by[False].memory[1].activations, 0)
    assert by[False].pred_step_ms < by["rank 0"].pred_step_ms < by[True].pred_step_ms


def test_recompute_stages_needs_checkpointing_and_existing_stages():
    with pytest.raises(ValueError, match="set trainer.recompute=full or selective"):
        compose_config(["trainer.recompute_stages=[0]"])
    with pytest.raises(ValueError, match="stage 2 does not exist"):
        _sleep_plan("1f1b", "trainer.recompute_stages=[0,2]")
    plan = _sleep_plan("1f1b", "trainer.recompute_stages=[0]")  # BW pays f on stage 0 alone
    assert plan.recompute_stages == {0} and (plan.stage_costs.b, plan.stage_costs.w) == ((40.0, 20.0), (20.0, 20.0))


@pytest.mark.parametrize("w_keep", [0.0, 1.0])
def test_recompute_keeps_inputs_until_w_on_its_stages_only(w_keep):
    """A recomputing stage keeps its layer inputs until W recomputes from them, whatever plan.w_keep; a
    stage that does not recompute frees (1 - w_keep) at B. zb_auto is searched under the same rule, so
    its rows fit the budgets they were searched for (before: with w_keep=0, the all-recompute zb_auto
    row was OOM on rank 1 at 0.02 GB and rank 1 of the partial zbh1 row was costed as if w_keep were 1)."""
    cfg = compose_config(["mode=plan", "model=gpt2-tiny", "plan.world_size=2", "plan.pp=[2]",
                          "plan.microbatch_sizes=[2]", "plan.schedules=[zbh1,zb_auto]", "plan.recompute=[false,true]",
                          "plan.recompute_partial=true",
                          "plan.prune=false", "data.batch_size=32", "data.seq_len=64", "plan.memory_gb=0.03",
                          "plan.margin=0", f"plan.w_keep={w_keep}"])
    rows = {(r.candidate.schedule, r.candidate.recompute_label): r for r in make_rows(cfg)[0] if r.candidate.pp == 2}
    plain, some = rows[("zbh1", "no")].memory, rows[("zbh1", "rank 0")].memory
    assert some[1].activations == pytest.approx(plain[1].activations)  # rank 1 does not recompute
    assert some[0].activations < plain[0].activations
    assert rows[("zb_auto", "yes")].feasible and rows[("zb_auto", "rank 0")].feasible


@pytest.mark.parametrize("dp_shard", [False, True])
def test_bf16_rows_keep_autocasts_weight_copies_per_microbatch_in_flight(dp_shard):
    """Under trainer.precision=bf16 each microbatch's forward makes its own bf16 copies of the Linear
    weights (a new autocast region each) and its graph holds them until its backward: gpipe's 8
    microbatches in flight hold 8 copies of the stage's weights beside the activations. FSDP2 rows
    compute in bf16 parameters (parallel.param_dtype) and make none."""
    from pipetrain.planner.cmd import workload

    base = ["mode=plan", "model=gpt2-tiny", "plan.world_size=4", "plan.pp=[2]", "plan.schedules=[gpipe]",
            "plan.microbatch_sizes=[2]", "data.batch_size=32", "data.seq_len=64", "plan.memory_gb=1", "plan.margin=0",
            "plan.prune=false", f"plan.dp_shard={str(dp_shard).lower()}"]
    fp32 = make_rows(compose_config(base))[0][0]
    bf16_cfg = compose_config([*base, "trainer.precision=bf16"])
    bf16 = make_rows(bf16_cfg)[0][0]
    assert (fp32.candidate.pp, fp32.candidate.dp, fp32.candidate.microbatches) == (2, 2, 8)
    copies = workload(bf16_cfg).weight_copy_bytes
    bounds = partition(workload(bf16_cfg).layers(2), 2, bf16.candidate.partition).bounds
    for r, rng in enumerate(bounds):
        extra = 0.0 if dp_shard else 8 * sum(copies[i] for i in rng)
        assert bf16.memory[r].activations - fp32.memory[r].activations == pytest.approx(extra), r
    assert dp_shard or min(sum(copies[i] for i in rng) for rng in bounds) > 0
    if dp_shard:  # FSDP2 told to compute in fp32 parameters under bf16: autocast copies them again
        f32 = make_rows(compose_config([*base, "trainer.precision=bf16", "parallel.dp_shard=2",
                                        "parallel.param_dtype=float32"]))[0][0]
        assert f32.memory[0].activations - fp32.memory[0].activations == pytest.approx(
            8 * sum(copies[i] for i in bounds[0]))


def test_the_loss_is_costed_once_for_a_model_whose_formula_leaves_it_out():
    """mlp's analytic last layer keeps its input only; its MSE loss keeps the output and target beside
    it: the last rank's activations are the layer's and the loss's, each once (the language models'
    formula counts the loss in the head, and the planner takes it out there before adding it back)."""
    from pipetrain.planner.cmd import workload

    cfg = compose_config(["mode=plan", "model=mlp", "plan.world_size=2", "plan.pp=[2]", "plan.schedules=[1f1b]",
                          "plan.microbatch_sizes=[4]", "data.batch_size=8", "plan.memory_gb=1", "plan.margin=0"])
    work = workload(cfg)
    from pipetrain.plan import build_model

    analytic = build_model(cfg.model, device="meta").cost_model(microbatch=4, seq=1, tflops=1.0)[-1]
    assert work.layers(4)[-1].activation_bytes_per_token == analytic.activation_bytes_per_token
    assert work.loss_bytes_per_token > 0
    row = make_rows(cfg)[0][0]
    bounds = partition(work.layers(4), 2, row.candidate.partition).bounds
    last = math.fsum(work.layers(4)[i].activation_bytes_per_token for i in bounds[1]) * 4
    assert row.memory[1].activations == pytest.approx(last + work.loss_bytes_per_token * 4)  # 1 in flight


def test_plan_partitions_searches_the_cut_and_a_row_trains_its_own():
    """plan.partitions tries each strategy; a row's partition is the one its config trains with (it
    simulates to the row's step time); strategies that cut alike are one row (the first listed)."""
    base = ["mode=plan", "model=gpt2", "plan.world_size=4", "plan.memory_gb=8", "data.batch_size=16",
            "data.seq_len=256", "plan.schedules=[1f1b,zbv]", "plan.pp=[4]", "plan.microbatch_sizes=[1]",
            "plan.prune=false", "plan.p2p_gbs=1000000"]  # transfers free, as mode=simulate's sim.comm_ms=0 has them
    cfg = compose_config([*base, "plan.partitions=[uniform,params,flops,balanced]"])
    rows, meta = make_rows(cfg)
    by = {(r.candidate.schedule, r.candidate.partition): r for r in rows}
    # balanced cuts GPT-2 as flops does (merged into flops, listed first); under zbv's 8 stages flops cuts as params
    assert {p for s, p in by if s == "1f1b"} == {"uniform", "params", "flops"}
    assert {p for s, p in by if s == "zbv"} == {"uniform", "params"}
    assert meta["merged"] == 3 and len(rows) == meta["candidates"] - 3 == 5
    assert by["1f1b", "uniform"].cut != by["1f1b", "flops"].cut
    # the embedding and head hold most parameters: a params cut puts fewer blocks beside them
    assert by["1f1b", "params"].cut[0][1] < by["1f1b", "uniform"].cut[0][1]
    for row in rows[:3]:
        run_cfg = apply_row(cfg, row)
        assert run_cfg.partition.name == row.candidate.partition
        plan = make_plan(dataclasses.replace(run_cfg, mode=cfg.mode))
        assert tuple((r.start, r.stop) for r in plan.partition.bounds) == row.cut
        sim = simulate(plan.schedule, plan.stage_costs, comm_ms=run_cfg.sim.comm_ms, reduce_ms=plan.reduce_ms)
        assert sim.makespan_with_reduce == pytest.approx(row.pred_step_ms, rel=1e-6), row.to_json()
    # the sleep model's equal layers cut alike by every strategy: one row each, the first listed's, merged
    # before pruning (a pruned row of the second strategy would stand beside the first's)
    for prune in ("false", "true"):
        one, meta1 = make_rows(compose_config([*SLEEP, "plan.memory_gb=1", "plan.partitions=[uniform,params]",
                                               f"plan.prune={prune}"]))
        assert meta1["merged"] == len(one) and {r.candidate.partition for r in one} == {"uniform"}


@pytest.mark.parametrize("override,message", [
    ("plan.partitions=[manual]", "plan.partitions"),
    ("plan.partitions=[profile]", "partition=profile"),
])
def test_plan_partitions_bad_input_says_what_to_change(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_rows(compose_config(["mode=plan", "model=gpt2-tiny", override]))


def test_one_group_transport_refuses_rows_that_would_hang_on_nccl():
    """Under pipeline.p2p_transport=one_group (one NCCL stream per rank) an interleaved row at pp=4
    would hang on its first step: the planner says so instead of ranking it (review F1); the default
    pair_groups transport runs the same row."""
    base = [*SLEEP, "plan.schedules=[interleaved_1f1b]", "plan.pp=[4]", "plan.virtual_stages=[2]"]
    pair = [r for r in make_rows(compose_config(base))[0] if r.candidate.pp == 4]
    one = [r for r in make_rows(compose_config([*base, "pipeline.p2p_transport=one_group"]))[0] if r.candidate.pp == 4]
    assert pair and all(r.feasible for r in pair)
    assert one and not any(r.feasible for r in one)
    assert all("hangs on NCCL under pipeline.p2p_transport=one_group" in r.reason for r in one), [r.reason for r in one]


@pytest.mark.parametrize("overrides, why", [
    # issue 25: a pp that cannot divide the world was answered with advice about the batch
    (["plan.pp=[3]"], "no pipeline degree in plan.pp=[3] divides the world of 4 ranks (pp x dp = world): "
                      "list some of 1, 2, 4 in plan.pp"),
    (["plan.pp=[4]", "plan.virtual_stages=[4]", "plan.schedules=[interleaved_1f1b]", "model.layers=8"],
     "every layout cuts the model into more stages than its 8 layers (the fewest: 16)"),
    (["plan.global_batch=3", "plan.microbatch_sizes=[2]"], "make plan.global_batch a multiple of dp x a microbatch"),
    (["plan.max_microbatches=2", "plan.microbatch_sizes=[1]"],
     "every row needs more than plan.max_microbatches=2 microbatches"),
    # context parallel is a factor of the world too
    (["model=llama-tiny", "plan.cp=[8]"], "no cp x tp of plan.cp=[8] and plan.tp=[1] divides the world of 4 ranks"),
    (["model=llama-tiny", "plan.cp=[2]", "plan.pp=[4]"],
     "no pipeline degree in plan.pp=[4] divides the world of 4 ranks (pp x dp x cp in plan.cp=[2] = world): "
     "list some of 1, 2"),
])
def test_an_empty_plan_space_says_why_first(overrides, why):
    from pipetrain.planner.cmd import plan_candidates

    config = compose_config(["mode=plan", "model=sleep", "plan.world_size=4", *overrides])
    with pytest.raises(ValueError) as info:
        plan_candidates(config)
    msg = str(info.value)
    head = ("the plan space is empty for world 4 and global batch "
            f"{config.plan.global_batch or config.data.batch_size}: ")
    assert msg.startswith(head + why) and "\n" not in msg
