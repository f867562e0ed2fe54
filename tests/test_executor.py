"""Tier 2: every schedule on real gloo processes equals single-process training.

For P in {2, 4} (v=2 for interleaved and looped BFS) with GPT-2 tiny (tied embedding and
head) and the MLP: after one step the loss and every gradient match the unsplit model
within 1e-5 (fp32); after three SGD-momentum steps the parameters still match; tied and mirrored
copies stay identical. Point-to-point runs in the in-order gloo mode (pipeline.p2p_in_order):
NCCL's semantics, so what would deadlock or mix up messages on GPUs fails here.
"""

from __future__ import annotations

import threading

import pytest
import torch

from _dist import spawn
from pipetrain.models.factory import build_model
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.train.pipeline import build_rank_pipeline
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
        rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=MB, seq_len=SEQ, timeout_s=60,
                                 p2p_in_order=True, seed=0)
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
def test_activation_checkpointing_same_gradients_less_memory(name):
    """P=1 runs the same executor without communication: the reference path of pipeline.degree=1."""
    results = {}
    for ckpt in (False, True):
        model = make_model("gpt2-tiny")
        sched = registry.build(name, 1, M, 1)
        rp = build_rank_pipeline(model, [range(len(model.layers))], sched, 0, microbatch_size=MB, seq_len=SEQ,
                                 activation_checkpointing=ckpt)
        res = rp.train_step(batches(model, 0))
        results[ckpt] = (res, {n: p.grad.clone() for _, n, p in rp.named_parameters()})
    (plain, g0), (ckpt, g1) = results[False], results[True]
    assert plain.loss == pytest.approx(ckpt.loss, abs=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=0)
    assert ckpt.peak_activation_bytes < 0.5 * plain.peak_activation_bytes


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
                                 microbatch_size=MB, seq_len=SEQ, activation_checkpointing=recompute)
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
