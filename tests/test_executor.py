"""Tier 2: every schedule on real gloo processes equals single-process training.

For P in {2, 4} (v=2 for interleaved and looped BFS) with GPT-2 tiny (tied embedding and
head) and the MLP: after one step the loss and every gradient match the unsplit model
within 1e-5 (fp32); after three SGD-momentum steps the parameters still match; tied and mirrored
copies stay identical. Point-to-point runs in the in-order gloo mode (pipeline.p2p_in_order):
NCCL's semantics, so what would deadlock or mix up messages on GPUs fails here.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from _dist import spawn
from pipetrain.metrics.measure import measure_step
from pipetrain.metrics.records import RankSample
from pipetrain.models.factory import build_model
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.runtime.clock import StepClock
from pipetrain.parallel.parallelize import Parallelize
from pipetrain.train.pipeline import Transport, build_rank_pipeline
from pipetrain.schedules import registry

V = {"interleaved_1f1b": 2, "looped_bfs": 2}
# SGD with momentum (stateful) rather than Adam: Adam divides by sqrt(v), which turns the
# 1e-9 noise of exactly-zero gradients (e.g. the key bias) into lr-sized steps.
M, MB, SEQ, STEPS, LR = 8, 2, 16, 3, 0.1


def make_model(name: str, device: str = "cpu"):
    """Seed 0 (init.py): the reference is built for real, the pipelines on meta and
    materialized stage by stage, as the trainer builds them; the weights are the same."""
    with torch.device(device):
        return build_model("gpt2-tiny", dropout=0.0) if name == "gpt2-tiny" else build_model("mlp", n_layer=8)


def batches(model, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [model.example_batch(microbatch=MB, seq=SEQ, generator=g) for _ in range(M)]


def schedule_names(P: int) -> list[str]:
    return [n for n in registry.names() if registry.get(n).is_valid(P, M, V.get(n, 1))]


def run_all_schedules(rank: int, world: int, out, model_name: str) -> None:
    results = {}
    for name in schedule_names(world):
        model = make_model(model_name, device="meta")
        sched = registry.build(name, world, M, V.get(name, registry.get(name).fixed_stages_per_rank or 1))
        bounds = uniform_bounds(len(model.layers), sched.placement.num_chunks)
        rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=MB, seq_len=SEQ, seed=0,
                                 transport=Transport(timeout_s=60, in_order=True))
        opt = torch.optim.SGD(rp.parameters(), lr=LR, momentum=0.9)
        first = None
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            res = rp.train_step(batches(model, step))
            if step == 0:
                first = {"loss": res.loss,
                         "grads": [(s, n, p.grad.clone()) for s, n, p in rp.named_parameters()]}
            opt.step()
        results[name] = {**first, "params": [(s, n, p.detach().clone()) for s, n, p in rp.named_parameters()]}
        rp.close()  # in-order mode's stream threads (one per peer) end with the pipeline, not with the process
        streams = [t.name for t in threading.enumerate() if t.name.startswith("p2p-stream")]
        assert not streams, (name, streams)
    torch.save(results, out / f"rank{rank}.pt")


def reference(model_name: str):
    model = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    first = None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in batches(model, step):
            loss = model.loss(model(x), y)
            total += loss.item()
            (loss / M).backward()
        if step == 0:
            first = {"loss": total / M,
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}}
        opt.step()
    first["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return first


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("model_name", ["gpt2-tiny", "mlp"])
def test_every_schedule_matches_single_process(tmp_path, P, model_name):
    spawn(run_all_schedules, P, tmp_path, model_name)
    ref = reference(model_name)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(P)]
    names = schedule_names(P)
    assert len(names) == len(registry.names()), "every schedule runs at this P and M"
    for name in names:
        seen: dict[str, list[torch.Tensor]] = {}
        for r in range(P):
            got = per_rank[r][name]
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5), (name, r)
            for _, n, g in got["grads"]:
                torch.testing.assert_close(g, ref["grads"][n], atol=1e-5, rtol=0, msg=f"{name} rank {r} grad {n}")
            for _, n, p in got["params"]:
                torch.testing.assert_close(p, ref["params"][n], atol=1e-5, rtol=0, msg=f"{name} rank {r} param {n}")
                seen.setdefault(n, []).append(p)
        # every parameter of the unsplit model lives somewhere; copies (tied, mirrored) are identical
        assert set(seen) == set(ref["params"])
        for n, copies in seen.items():
            for c in copies[1:]:
                assert torch.equal(c, copies[0]), (name, n)


@pytest.mark.pure
@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_loss_gradient_seed_is_exactly_loss_over_m(name):
    """B starts from the loss with the gradient 1/M (no loss / M node in the graph): the weight
    gradients are bit for bit those of (loss / M).backward() per microbatch, in the same order,
    at an M whose 1/M is not exact in binary; and the step's loss is the mean of the losses."""
    m = 3
    model = make_model("mlp")
    mbs = batches(model, 0)[:m]
    sched = registry.build(name, 1, m, 1)
    rp = build_rank_pipeline(model, [range(len(model.layers))], sched, 0, microbatch_size=MB, seq_len=SEQ, seed=0)
    res = rp.train_step(mbs)
    ref = make_model("mlp")
    ref.load_state_dict({n: p.detach() for _, n, p in rp.named_parameters()})  # strict: every name matches
    losses = []
    for x, y in mbs:
        loss = ref.loss(ref(x), y)
        losses.append(loss.item())
        (loss / m).backward()
    got = {n: p.grad for _, n, p in rp.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.grad), n
    assert res.loss == sum(losses) / m


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.pure
@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_activation_checkpointing_same_gradients_less_memory(name):
    """P=1 runs the same executor without communication: the reference path of pipeline.degree=1."""
    results = {}
    for ckpt in (False, True):
        model = make_model("gpt2-tiny")
        sched = registry.build(name, 1, M, 1)
        rp = build_rank_pipeline(model, [range(len(model.layers))], sched, 0, microbatch_size=MB, seq_len=SEQ,
                                 parallelize=Parallelize(recompute=ckpt))
        res = rp.train_step(batches(model, 0))
        results[ckpt] = (res, {n: p.grad.clone() for _, n, p in rp.named_parameters()})
    (plain, g0), (ckpt, g1) = results[False], results[True]
    assert plain.loss == pytest.approx(ckpt.loss, abs=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=0)
    assert ckpt.peak_activation_bytes < 0.5 * plain.peak_activation_bytes


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.pure
def test_recompute_on_some_stages_same_gradients_memory_between():
    """trainer.recompute_stages: two stages on one rank (looped placement, v=2); stage 0 alone
    recomputing keeps gradients equal and its activations between none and all recomputing."""
    results = {}
    for recompute in (False, {0}, True):
        model = make_model("gpt2-tiny")
        sched = registry.build("interleaved_1f1b", 1, M, 2)
        half = len(model.layers) // 2
        rp = build_rank_pipeline(model, [range(half), range(half, len(model.layers))], sched, 0,
                                 microbatch_size=MB, seq_len=SEQ, parallelize=Parallelize(recompute=recompute))
        assert [m.checkpoint_layers for _, m in sorted(rp.stages.items())] == \
            ([recompute] * 2 if isinstance(recompute, bool) else [True, False])
        res = rp.train_step(batches(model, 0))
        results[str(recompute)] = (res, {n: p.grad.clone() for _, n, p in rp.named_parameters()})
    (plain, g0), (some, g1), (every, g2) = results["False"], results["{0}"], results["True"]
    assert plain.loss == pytest.approx(some.loss, abs=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=0)
        torch.testing.assert_close(g2[n], g0[n], atol=1e-6, rtol=0)
    assert every.peak_activation_bytes < some.peak_activation_bytes < plain.peak_activation_bytes


# ---- inputs moved once per step (F10); ranks on one axis by a collective (F12) ----------------

class Noted(torch.Tensor):
    """A microbatch tensor that notes each `.to()` of it in its process's log; what comes out is
    a plain tensor, so the step computes as it would on plain ones."""

    @classmethod
    def of(cls, t: torch.Tensor, log: list, what: str) -> "Noted":
        out = t.as_subclass(cls)
        out.log, out.what = log, what
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            args[0].log.append(("to", args[0].what))
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


LATE_S, SKEW_S = 0.1, 3600.0


def late_and_skewed(rank: int, world: int, out) -> None:
    """Rank 1 starts each step LATE_S after rank 0, and its host timer reads an hour ahead (as
    another host's clock might); every move of a microbatch tensor and every stage forward is logged."""
    model = make_model("mlp", device="meta")
    sched = registry.build("1f1b", world, 4)
    rp = build_rank_pipeline(model, uniform_bounds(len(model.layers), world), sched, rank, microbatch_size=MB,
                             transport=Transport(timeout_s=60), seed=0)
    rp.executor.recorder.clock = StepClock(torch.device("cpu"), host_clock=lambda: time.perf_counter() + SKEW_S * rank)
    log: list = []
    for s, mod in rp.stages.items():
        mod.register_forward_pre_hook(lambda *_, s=s: log.append(("F", s)))
    steps = []
    for step in range(2):
        mbs = [(Noted.of(x, log, "input"), Noted.of(y, log, "target")) for x, y in batches(model, step)[:4]]
        del log[:]
        dist.barrier()
        if rank == 1:
            time.sleep(LATE_S)
        began = time.time()  # one host here: its clock is the truth the measurement must agree with
        res = rp.train_step(mbs)
        sample = RankSample(rank=rank, step_ms=res.step_ms, timings=res.timings, sync_ms=res.sync_ms)
        steps.append({"sample": sample, "began": began, "log": list(log)})
    torch.save(steps, out / f"rank{rank}.pt")


@pytest.mark.dist
def test_inputs_move_once_before_the_step_and_ranks_align_on_a_collective_not_host_clocks(tmp_path):
    spawn(late_and_skewed, 2, tmp_path)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    sched = registry.build("1f1b", 2, 4)
    for step in range(2):
        got = [per_rank[r][step] for r in range(2)]
        # F10: rank 0 (first stage) moves its 4 inputs, rank 1 (last stage) its 4 targets, each once
        # and all before the step's first forward (not one at each forward or loss); no rank moves
        # what it does not read
        for r, want in ((0, "input"), (1, "target")):
            log = got[r]["log"]
            first_f = next(i for i, e in enumerate(log) if e[0] == "F")
            assert [e for e in log if e[0] == "to"] == [("to", want)] * 4, (r, log)
            assert all(e[0] == "to" for e in log[:first_f]) and first_f == 4, (r, log)
        # F12: rank 1's host timer is an hour off, yet the measured start of its step lies where this
        # host's one clock puts it (LATE_S after rank 0's), and the makespan is the step's, not an hour
        m = measure_step(step + 1, sched, [g["sample"] for g in got])
        true_late_ms = (got[1]["began"] - got[0]["began"]) * 1e3
        assert true_late_ms >= LATE_S * 1e3 * 0.9
        assert m.offsets_ms[0] == 0.0 and abs(m.offsets_ms[1] - true_late_ms) < 25.0, (m.offsets_ms, true_late_ms)
        assert true_late_ms < m.makespan_ms < true_late_ms + 1000.0



def mirrored_sums(rank: int, world: int, out) -> None:
    got = {}
    for early in (True, False):
        model = make_model("gpt2-tiny", device="meta")
        sched = registry.build("dualpipe", world, 4, 2)
        bounds = uniform_bounds(len(model.layers), sched.placement.num_chunks)
        rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=MB, seq_len=SEQ, seed=0,
                                 transport=Transport(timeout_s=60, in_order=True))
        if not early:  # the sums after the last action, as under data parallel
            rp.executor._hooks.clear()
        rp.train_step(batches(model, 0)[:4])
        got[early] = {"grads": [(s, n, p.grad.clone()) for s, n, p in rp.named_parameters()],
                      "started": list(rp.sync.last_started_at), "actions": sum(1 for _ in sched.actions(rank))}
        rp.close()
    torch.save(got, out / f"rank{rank}.pt")


@pytest.mark.dist
def test_mirrored_copies_are_summed_during_the_step_with_the_same_gradients(tmp_path):
    """DualPipe at P=2 holds the whole model on each rank (two mirrored chunks). The chunk whose last
    weight gradient comes first on both ranks has its sum issued there, under the other chunk's last
    backward (GradSync.early), not after the last action; the gradients are those of summing both
    chunks after the step, bit for bit."""
    spawn(mirrored_sums, 2, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        early, late = got[True], got[False]
        assert [b for _, b in early["started"]] and min(b for _, b in early["started"]) < early["actions"], early
        assert late["started"] == []
        for (s, n, g), (s2, n2, g2) in zip(early["grads"], late["grads"], strict=True):
            assert (s, n) == (s2, n2) and torch.equal(g, g2), (rank, s, n)
