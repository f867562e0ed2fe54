"""The executor's recorder (runtime/recorder.py): what a measured step records, and that an
unmeasured step (the trainer's unlogged ones, `Executor.measure = False`) records nothing yet
computes exactly the same losses and gradients.

Pure tier: the recorder driven by hand on a counting host clock (every mark one tick, so every
time is known), and P=1 pipelines (no transport) measured and unmeasured. Dist tier: P=2 on
gloo, where sends and receives are recorded too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from _dist import spawn
from pipetrain.models.factory import build_model
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.runtime.clock import StepClock
from pipetrain.runtime.recorder import Recorder, StepRecorder
from pipetrain.schedules import registry
from pipetrain.schedules.p2p import Kind, Message
from pipetrain.train.pipeline import Transport, build_rank_pipeline

M, MB, SEQ = 4, 2, 8


def counting_clock() -> StepClock:
    """A host timer that advances 1 ms per reading: mark k is at k ms."""
    ticks = itertools.count()
    return StepClock(torch.device("cpu"), host_clock=lambda: next(ticks) / 1e3)


@pytest.mark.pure
def test_marks_become_timings_waits_and_comm_events():
    """Step 0 is an F&B pair whose backward waited for a gradient; step 1 an F that sent."""
    rec = StepRecorder(torch.device("cpu"), ["0F1&0B0", "0F2"], reducer=None)
    rec.clock = counting_clock()
    grad = Message(Kind.GRAD, 1, 0, src=1, dst=0)
    act = Message(Kind.ACT, 0, 2, src=0, dst=1)
    rec.begin_step()  # mark 0: t=0
    rec.begin(0)  # 1
    rec.part_done()  # 2: the forward part took 1 ms
    since = rec.mark()  # 3
    rec.received(grad, since)  # 4: waited 1 ms
    rec.part_done()  # 5: the backward part spanned 3 ms, 1 of them waiting
    rec.begin(1)  # 6
    rec.sent(act)  # 7
    rec.part_done()  # 8
    rec.end_compute()  # 9
    rec.end_step()  # 10
    rec.synced()  # 11
    res = rec.result(1.5, {1: 64})
    (pair, fwd) = res.timings
    assert (pair.index, pair.step, pair.start_ms, pair.end_ms) == (0, "0F1&0B0", 1.0, 5.0)
    assert pair.wait_ms == pytest.approx(1.0) and pair.part_ms == pytest.approx((1.0, 2.0))
    assert (fwd.start_ms, fwd.end_ms, fwd.wait_ms, fwd.part_ms) == (6.0, 8.0, 0.0, (2.0,))
    recv, send = res.comm
    assert (recv.direction, recv.peer, recv.action, recv.start_ms, recv.end_ms) == ("recv", 1, 0, 3.0, 4.0)
    assert (send.direction, send.peer, send.action, send.start_ms) == ("send", 1, 1, 7.0)
    assert (res.loss, res.step_ms, res.sync_ms, res.reduce_exposed_ms) == (1.5, 10.0, 11.0, 1.0)
    assert res.peak_recv_buffer_bytes == {1: 64}


@pytest.mark.pure
def test_activation_sets_and_bytes_peak_as_forwards_save_and_backwards_free():
    rec = StepRecorder(torch.device("cpu"), [], reducer=None)
    rec.begin_step()
    w = torch.randn(4, 4, requires_grad=True)
    for m in range(3):
        with rec.saving(0, m):
            torch.tanh(torch.randn(2, 4) @ w).sum()  # saves the (2, 4) input and tanh's (2, 4) output
        if m == 1:
            rec.freed(0, 0)
    res = rec.result(None, {})
    assert res.peak_activation_sets == 2  # (0, 0) freed before (0, 2) was saved
    assert res.peak_activation_bytes == 2 * 2 * (2 * 4 * 4)  # two sets of two fp32 (2, 4) tensors


@pytest.mark.pure
def test_an_unmeasured_step_records_nothing_but_the_loss():
    rec = Recorder()
    rec.begin_step()
    rec.begin(0)
    rec.received(Message(Kind.ACT, 0, 0, src=0, dst=1), rec.mark())
    with rec.saving(0, 0):
        pass
    rec.part_done()
    res = rec.result(2.0, {})
    assert (res.loss, res.timings, res.comm, res.step_ms, res.sync_ms, res.peak_activation_bytes) == \
        (2.0, [], [], 0.0, None, 0)


@pytest.mark.pure
def test_collectives_reach_the_action_running_only_while_a_step_is_measured():
    """runtime/collectives.py: from begin_step to end_step the recorder is the sink; an all-to-all
    blocking from its start, one started early and waited later (node mode), and a node's span go to
    the step that ran them; the trace draws the two overlapping all-to-alls on two rows, the node on its own."""
    from pipetrain.loggers.trace import measured_trace
    from pipetrain.metrics.measure import measure_step
    from pipetrain.metrics.records import RankSample
    from pipetrain.runtime import collectives

    rec = StepRecorder(torch.device("cpu"), ["0F0", "0B0"], reducer=None)
    rec.clock = counting_clock()
    Recorder().begin_step()  # an unmeasured step: nothing to report to
    assert collectives.sink() is None
    rec.begin_step()  # mark 0
    tap = collectives.sink()
    assert tap is rec
    rec.begin(0)  # 1
    t0 = tap.mark()  # 2
    tap.collective("ep", "a2a:dispatch", 64, t0, t0)  # arrived at 3: blocking, all exposed
    rec.part_done()  # 4
    rec.begin(1)  # 5
    early = tap.mark()  # 6

    def attn() -> None:  # a node, from mark 7 to 13
        t1 = tap.mark()  # 8
        tap.collective("ep", "a2a:combine B", 32, t1, tap.mark())  # waited from 9, arrived at 10
        tap.collective("ep", "a2a:dispatch B", 16, early, tap.mark())  # issued at 6, waited from 11, arrived at 12

    collectives.run_node(attn, "attn", "0", 0, "B")
    rec.part_done()  # 14
    rec.end_compute()
    rec.end_step()
    assert collectives.sink() is None  # past the step: unmeasured again
    ran: list[int] = []
    collectives.run_node(lambda: ran.append(1), "attn", "0", 1, "F")  # runs, and reports nothing
    assert ran == [1] and len(rec._colls) == 4
    fwd, bwd = rec.result(None, {}).timings
    (a,) = fwd.collectives
    assert (a.group, a.label, a.nbytes, a.start_ms, a.total_ms, a.exposed_ms) == ("ep", "a2a:dispatch", 64, 2, 1, 1)
    assert [(c.label, c.start_ms, c.wait_from_ms, c.end_ms) for c in bwd.collectives] == [
        ("a2a:dispatch B", 6, 11, 12), ("attn L0 mb0 B", 7, 13, 13), ("a2a:combine B", 8, 9, 10)]  # by issue
    m = measure_step(1, registry.build("1f1b", 1, 1), [RankSample(0, 15.0, [fwd, bwd])])
    rows = {e["tid"]: e["args"]["name"] for e in measured_trace(m)["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(rows.values()) == ["rank 0 (stage 0)", "rank 0 all-to-all / cp", "rank 0 all-to-all / cp 2",
                                     "rank 0 nodes"]


def grads_of(rp) -> dict[str, torch.Tensor]:
    return {f"{s}.{n}": p.grad.clone() for s, n, p in rp.named_parameters()}


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.pure
@pytest.mark.parametrize("name", ["1f1b", "zbh1", "interleaved_1f1b"])
def test_unmeasured_steps_compute_exactly_what_measured_ones_do(name):
    """P=1 (no transport): the same pipeline, one step measured then one unmeasured from the same
    weights, gives bit-identical loss and gradients; only the measured one has timings."""
    model = build_model("gpt2-tiny", dropout=0.0)
    sched = registry.build(name, 1, M, 2 if name == "interleaved_1f1b" else 1)
    bounds = uniform_bounds(len(model.layers), sched.placement.num_chunks)
    rp = build_rank_pipeline(model, bounds, sched, 0, microbatch_size=MB, seq_len=SEQ)
    g = torch.Generator().manual_seed(0)
    mbs = [model.example_batch(microbatch=MB, seq=SEQ, generator=g) for _ in range(M)]
    out = {}
    for measure in (True, False, True):
        rp.executor.measure = measure
        for mod in rp.stages.values():
            mod.zero_grad(set_to_none=True)
        res = rp.train_step(mbs)
        out.setdefault(measure, []).append((res, grads_of(rp)))
    (measured, g0), (again, g2) = out[True]
    ((unmeasured, g1),) = out[False]
    assert measured.loss == unmeasured.loss == again.loss
    for k in g0:
        assert torch.equal(g0[k], g1[k]) and torch.equal(g0[k], g2[k]), k
    assert len(measured.timings) == len(sched.steps[0]) and measured.peak_activation_bytes > 0
    assert unmeasured.timings == [] and unmeasured.peak_activation_bytes == 0
    assert again.timings and again.peak_activation_bytes == measured.peak_activation_bytes


def measured_and_unmeasured(rank: int, world: int, out) -> None:
    results = {}
    for name in ("1f1b", "zbv"):
        model = build_model("mlp", n_layer=4)
        sched = registry.build(name, world, M, registry.get(name).fixed_stages_per_rank or 1)
        rp = build_rank_pipeline(model, uniform_bounds(4, sched.placement.num_chunks), sched, rank,
                                 microbatch_size=MB, transport=Transport(timeout_s=60), seed=0)
        g = torch.Generator().manual_seed(0)
        mbs = [model.example_batch(microbatch=MB, generator=g) for _ in range(M)]
        for measure in (True, False):
            rp.executor.measure = measure
            for mod in rp.stages.values():
                mod.zero_grad(set_to_none=True)
            res = rp.train_step(mbs)
            results[(name, measure)] = (res.loss, len(res.timings), len(res.comm), grads_of(rp))
        rp.close()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.mark.dist
def test_unmeasured_steps_over_gloo_match_measured_ones_and_record_no_comm(tmp_path):
    spawn(measured_and_unmeasured, 2, tmp_path)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in ("1f1b", "zbv"):
            loss, timings, comm, grads = results[(name, True)]
            loss_u, timings_u, comm_u, grads_u = results[(name, False)]
            assert loss == loss_u and timings > 0 and comm > 0 and timings_u == comm_u == 0, (rank, name)
            for k in grads:
                assert torch.equal(grads[k], grads_u[k]), (rank, name, k)
