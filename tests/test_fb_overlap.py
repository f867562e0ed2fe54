"""DualPipe-V's F&B pairs with their nodes interleaved (runtime/overlap.py, issue #29) on real gloo.

Two ranks, pp=1 x ep=2: each holds both V stages of a small MoE Llama (three MoE blocks and a dense
one, a shared expert, the aux balance loss) with half of every MoE layer's experts, and routes its own
microbatches. Every F&B pair runs interleaved (pipeline.fb_overlap=on: all-to-alls started async and
waited where their result is read) and serially by nodes ("serial"): the losses and every gradient
are bitwise equal, both ranks started the same all-to-alls in the same order, and the interleaved run
equals one process training on both ranks' microbatches with all the experts within 1e-5. The
measured steps carry every all-to-all inside the action that ran it (runtime/collectives.py): whole
stages ("off") block in each, the interleaved pairs hide part of theirs, as the metrics and trace show.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.models.split import tie_groups
from test_nodes import M, microbatches, tiny_moe

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EP = 2


def rank_batches(rank: int):
    return microbatches(rank)


def stages_of(rank: int, selective: bool = False):
    from pipetrain.models.split import split_model
    from pipetrain.parallel.ep import parallelize_experts
    from pipetrain.parallel.recompute import recompute_modules
    from pipetrain.partition.uniform import uniform_bounds
    from pipetrain.runtime.ep_comm import EPGroup
    import torch.distributed as dist

    model = tiny_moe()
    if selective:  # trainer.recompute=selective, every module the layers have
        for layer in model.layers:
            recompute_modules(layer, ("attention", "mlp_act", "norm", "moe_act"), compiled=False)
    stages = split_model(model, uniform_bounds(len(model.layers), 2))
    g = EPGroup(dist.group.WORLD, EP, rank)
    return {s: parallelize_experts(st, g) for s, st in enumerate(stages)}


def ep_rank(rank: int, world: int, out) -> None:
    from pipetrain.models.moe_block import set_aux_loss_scale
    from pipetrain.runtime.executor import Executor
    from pipetrain.runtime.overlap import NodeExecution
    from pipetrain.schedules import registry

    got = {}
    for run in ("off", "serial", "on", "selective serial", "selective on"):
        stages = stages_of(rank, selective=run.startswith("selective"))
        mode = run.split()[-1]
        for st in stages.values():  # each rank's objective: the mean over its M microbatches
            set_aux_loss_scale(st, 1.0 / M)
        ex = Executor(registry.build("dualpipev", 1, M, 2), 0, stages, comm=None, fb_overlap=mode)
        result = ex.step(rank_batches(rank))  # measured (Executor.measure): timings with their collectives
        if mode == "off":
            got[run] = {"timings": result.timings, "step_ms": result.step_ms}
            continue
        assert isinstance(ex.passes, NodeExecution) and ex.passes.interleave == (mode == "on")
        got[run] = {"loss": result.loss, "log": list(ex.passes.log.started), "a2a": ex.passes.log.summary(),
                     "timings": result.timings, "step_ms": result.step_ms,
                     "spans": [span[0] for span in ex.passes.log.spans],
                     "grads": {n: p.grad for st in stages.values() for n, p in st.named_parameters()}}
    torch.save(got, out / f"rank{rank}.pt")


def reference():
    from pipetrain.models.moe_block import set_aux_loss_scale

    model = tiny_moe()
    set_aux_loss_scale(model, 1.0 / (EP * M))
    total = 0.0
    for rank in range(EP):
        for x, y in rank_batches(rank):
            loss = model.loss(model(x), y)
            total += loss.item()
            (loss / (EP * M)).backward()
    return total / (EP * M), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fb")
    spawn(ep_rank, EP, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(EP)]


def test_interleaved_fb_equals_serial_bitwise_and_one_process(ep_runs):
    ranks = ep_runs
    ref_loss, ref_grads = reference()
    for r, got in enumerate(ranks):
        on, serial = got["on"], got["serial"]
        assert on["loss"] == serial["loss"], r
        for n, g in serial["grads"].items():
            assert (g is None) == (on["grads"][n] is None), n
            assert g is None or torch.equal(on["grads"][n], g), (r, n)
        assert on["loss"] == pytest.approx(ref_loss, rel=1e-5)
    log = ranks[0]["on"]["log"]
    assert len(log) == 3 * 2 * 2 * M, "per microbatch: 3 MoE layers x (dispatch, combine) x (F, B)"
    assert ranks[1]["on"]["log"] == log, "every EP rank starts the same all-to-alls in the same order"
    assert log != ranks[0]["serial"]["log"], "the interleaved order differs from the serial one"
    a2a = ranks[0]["on"]["a2a"]  # the step's all-to-all time: total, exposed in waits, their ratio
    assert 0 <= a2a["a2a_exposed_ms"] <= a2a["a2a_ms"] and a2a["a2a_ms"] > 0 and 0 <= a2a["a2a_overlap"] <= 1
    assert len(ranks[0]["on"]["spans"]) == len(log) and "a2a:dispatch L1 mb0 F" in ranks[0]["on"]["spans"]
    ties = tie_groups(tiny_moe())  # the head's copy of the embedding (another stage) sums into it
    summed: dict = {}
    for got in ranks:
        for n, g in got["on"]["grads"].items():
            if g is not None and ".experts." not in n:
                key = ties.get(n, n)
                summed[key] = summed[key] + g / EP if key in summed else g / EP
    assert summed.keys() == {n for n, g in ref_grads.items() if g is not None and ".experts." not in n}
    for n, g in summed.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    for r, got in enumerate(ranks):  # rank r holds experts [r E/ep, (r+1) E/ep): both ranks' tokens, / M
        for n, g in got["on"]["grads"].items():
            if ".experts." in n:
                e = g.shape[0]
                torch.testing.assert_close(g / EP, ref_grads[n][r * e:(r + 1) * e], rtol=1e-5, atol=1e-7, msg=n)


def test_selective_recompute_interleaved_equals_serial_and_no_recompute(ep_runs):
    """trainer.recompute=selective (parallel/recompute.py: every module the blocks declare) under
    pipeline.fb_overlap=on: the recomputed modules re-run inside each node's backward, interleaved as
    serially, and the gradients equal serial and the run without recompute within 1e-6."""
    for r, got in enumerate(ep_runs):
        on, serial, plain = got["selective on"], got["selective serial"], got["on"]
        assert on["loss"] == serial["loss"] == pytest.approx(plain["loss"], abs=1e-6), r
        for n, g in plain["grads"].items():
            for other in (on, serial):
                assert (g is None) == (other["grads"][n] is None), n
                if g is not None:
                    torch.testing.assert_close(other["grads"][n], g, rtol=0, atol=1e-6, msg=(r, n))


def test_the_all_to_alls_reach_the_timeline_trace_and_metrics(ep_runs):
    """Each rank's step as the trainer measures it (one pipeline rank per EP rank): every all-to-all
    inside its action, moe/a2a_* from them, whole stages all exposed, the interleaved pairs' labels
    those of the node log (and the counts exchanges beside them)."""
    from pipetrain.loggers.trace import measured_trace
    from pipetrain.metrics import names
    from pipetrain.metrics.measure import measure_step
    from pipetrain.metrics.records import RankSample
    from pipetrain.schedules import registry
    from test_moe_metrics import assert_inside_actions

    sched = registry.build("dualpipev", 1, M, 2)
    for got in ep_runs:
        m = {mode: measure_step(1, sched, [RankSample(0, run["step_ms"], run["timings"])])
             for mode, run in got.items()}
        rec = {mode: mm.record() for mode, mm in m.items()}
        off, on = rec["off"], rec["on"]
        assert off[names.MOE_A2A_EXPOSED_MS] == off[names.MOE_A2A_MS] > 0 and off[names.MOE_A2A_OVERLAP] == 0
        assert 0 < on[names.MOE_A2A_EXPOSED_MS] < on[names.MOE_A2A_MS] and 0 < on[names.MOE_A2A_OVERLAP] < 1
        labels = assert_inside_actions(measured_trace(m["off"]), "ep")
        assert labels == {"a2a:counts", "a2a:dispatch", "a2a:combine", "a2a:dispatch B", "a2a:combine B"}
        events = [c for t in got["on"]["timings"] for c in t.collectives if c.group == "ep"]
        assert sorted(c.label for c in events if c.label != "a2a:counts") == sorted(got["on"]["spans"])
        # every node of every interleaved pair is on the trace's nodes row, inside its action
        nodes = {c.label for t in got["on"]["timings"] for c in t.collectives if c.group == "node"}
        assert {"attn L1 mb0 F", "experts L1 mb0 F", "post L1 mb0 B"} <= nodes
        assert assert_inside_actions(measured_trace(m["on"]), "node") == nodes
        assert all(c.start_ms <= c.wait_from_ms <= c.end_ms for c in events)
        assert assert_inside_actions(measured_trace(m["on"]), "ep") >= set(got["on"]["spans"])
        rows = m["on"].timeline_rows()
        assert {r["step"] for r in rows if r["op"] == "ep"} == {c.label for c in events}


TIMEOUT_S = 3.0


def fail_in_node(rank: int, world: int, out) -> None:
    import os

    from pipetrain.runtime.executor import Executor
    from pipetrain.schedules import registry

    stages = stages_of(rank)
    ex = Executor(registry.build("dualpipev", 1, M, 2), 0, stages, comm=None, fb_overlap="on",
                  a2a_timeout_s=TIMEOUT_S)
    if rank == 1:
        calls = {"n": 0}

        def hook(module, inputs):
            calls["n"] += 1
            if calls["n"] == 3:  # mid-step: some all-to-alls of this step went out
                raise RuntimeError("router kernel failed")

        stages[1].layers["4"].mlp.router.register_forward_pre_hook(hook)
    try:
        ex.step(rank_batches(rank))
    except Exception as e:  # noqa: BLE001 - the error every rank shows is what is tested
        (out / f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}")
        os._exit(3)
    os._exit(0)


def test_one_ep_rank_failing_in_a_node_fails_every_rank_in_time(tmp_path):
    import time

    t0 = time.monotonic()
    ctx = spawn(fail_in_node, EP, tmp_path, join=False)
    for p in ctx.processes:
        p.join(timeout=60)
    assert time.monotonic() - t0 < 60
    assert [p.exitcode for p in ctx.processes] == [3, 3]
    victim = (tmp_path / "error1.txt").read_text()
    assert victim.startswith("NodeError") and "node 'attn'" in victim and "router kernel failed" in victim
    survivor = (tmp_path / "error0.txt").read_text()
    assert survivor.startswith("NodeError") and "pipeline.p2p_timeout_s" in survivor, survivor


def pp2_ep2_rank(rank: int, world: int, out) -> None:
    from pipetrain.models.moe_block import set_aux_loss_scale
    from pipetrain.parallel.ep import expert_parallel
    from pipetrain.parallel.layout import Layout
    from pipetrain.parallel.mesh import build_groups
    from pipetrain.parallel.parallelize import Parallelize
    from pipetrain.partition.uniform import uniform_bounds
    from pipetrain.schedules import registry
    from pipetrain.train.pipeline import Transport, build_rank_pipeline
    from test_nodes import MB, SEQ

    layout = Layout(pp=2, dp_shard=2, ep=2)  # no dp step in Parallelize: EP groups without FSDP2
    groups = build_groups(layout, "cpu")
    got = {}
    for mode in ("serial", "on"):
        model = tiny_moe()
        sched = registry.build("dualpipev", 2, M, 2)
        rp = build_rank_pipeline(model, uniform_bounds(len(model.layers), 4), sched, groups.pp_rank,
                                 microbatch_size=MB, seq_len=SEQ, parallelize=Parallelize(ep=expert_parallel(groups)),
                                 transport=Transport(timeout_s=60, group=groups.pp_group,
                                                     group_ranks=groups.pipeline_ranks, pipelines=layout.pipelines()),
                                 fb_overlap=mode)
        for st in rp.stages.values():
            set_aux_loss_scale(st, 1.0 / M)
        loss = rp.train_step(rank_batches(groups.ep_index)).loss
        got[mode] = {"loss": loss, "log": list(rp.executor.passes.log.started),
                     "grads": {f"{s}:{n}": p.grad for s, n, p in rp.named_parameters()}}
        rp.close()
    torch.save({"pp": groups.pp_rank, **got}, out / f"rank{rank}.pt")


def test_pp2_ep2_interleaved_equals_serial_bitwise(tmp_path):
    spawn(pp2_ep2_rank, 4, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for got in ranks:
        assert got["on"]["loss"] == got["serial"]["loss"]
        for n, g in got["serial"]["grads"].items():
            assert (g is None) == (got["on"]["grads"][n] is None), n
            assert g is None or torch.equal(got["on"]["grads"][n], g), n
    for pp in (0, 1):  # the two ranks of one EP group hold the same pipeline stages
        logs = [got["on"]["log"] for got in ranks if got["pp"] == pp]
        assert len(logs) == 2 and logs[0] == logs[1] and logs[0]
    assert any(got["on"]["log"] != got["serial"]["log"] for got in ranks), "some F&B pair interleaved"
