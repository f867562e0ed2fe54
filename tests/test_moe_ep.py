"""Expert parallel x FSDP2 x pipeline on real gloo processes (8 ranks): equal to one process.

moe-tiny (8 experts, top-2, the auxiliary balance loss) at pp=2 x dp_shard=2 x ep=2: each rank keeps
4 of every MoE layer's 8 experts and exchanges tokens with its EP peer by all-to-all; experts are
FSDP2-sharded over their own (here one-rank) mesh with the whole dp as divide factor. Under 1f1b,
zbv (split backward: the all-to-all's backward runs inside B) and dualpipev (DualPipe's mirror; whole
stages, and node by node with every F&B pair's forward and backward interleaved, pipeline.fb_overlap=on:
FSDP2's parameters gathered by the reducer, issue #29), and interleaved 1F1B paired for the same overlap
(Megatron's combined 1F1B) the losses of steps 1-3 and the parameters after 3 clipped AdamW steps equal a single process training
on the same microbatches (test_tensor_parallel.py's bounds), and ep=1 at the same layout too: no
"gradients doubled with EP=2". Under balance=aux_free ep=2 against ep=1 directly (issue #28): the
losses of 3 steps within 1e-6 relative, every reduced gradient of every step within 1e-5 relative
(by tensor norm), and the router biases moved by those steps bitwise equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import (BASE, STEPS, assert_ranks_equal, assert_resumes, full_parameters, reference,
                                  train_spawned)

from _dist import spawn
from pipetrain.plan import make_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUT = ["model=moe-tiny", "pipeline.degree=2", "parallel.dp_shard=2"]
CASES = {"ep2-1f1b": ["parallel.ep=2", "schedule=1f1b"], "ep2-zbv": ["parallel.ep=2", "schedule=zbv"],
         "ep2-dualpipev": ["parallel.ep=2", "schedule=dualpipev", "pipeline.fb_overlap=off"],
         "ep2-dualpipev-overlap": ["parallel.ep=2", "schedule=dualpipev", "pipeline.fb_overlap=on"],
         # combined 1F1B: schedules/lower.py pair_fb pairs interleaved 1F1B's steady state (execution.pairs_fb)
         "ep2-interleaved-overlap": ["parallel.ep=2", "schedule=interleaved_1f1b", "pipeline.fb_overlap=on"],
         "ep1-1f1b": ["schedule=1f1b"]}
# bias steps of +-0.01: every bias ends nonzero, and equal bits need equal sign(mean - count) per expert and step
AUX_FREE = ["schedule=1f1b", "model.moe.balance=aux_free", "model.moe.bias_update_rate=0.01"]


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    train_spawned(compose, out, [*BASE, *LAYOUT], CASES, 4)  # 1-row microbatches: 8 rows / (dp 2 x M 4)
    # one process, the same 1-row microbatches (the balance loss is per microbatch)
    return out, reference(compose, "moe-tiny", out / "reference", ("pipeline.microbatches=8",))


@pytest.mark.parametrize("name", list(CASES))
def test_ep_pipelines_equal_one_process(runs, name):
    out, ref = runs
    assert_ranks_equal(out, name, ref, 4)


def test_an_ep2_checkpoint_resumes_at_ep1_within_1e4(compose, tmp_path):
    """Experts are saved whole under their global index (gathered over the EP group), so a checkpoint of
    ep=2 x pp=2 (aux_free: the router biases move too) loads at ep=1 x pp=2 and continues."""
    assert_resumes(compose, tmp_path, [*BASE, *LAYOUT, "model.moe.balance=aux_free"], ["parallel.ep=2"], [])


def full_gradients(trainer) -> dict[str, torch.Tensor]:
    """Unsplit name -> the step's whole reduced gradient (FSDP2 shards and ep blocks gathered; collective)."""
    from torch.distributed.tensor import DTensor

    from pipetrain.parallel.tp import gather_full

    out = {}
    for s, name, p in trainer.pipe.named_parameters():
        if p.grad is None:  # the aux_free bias: moved by the pre-step hook, not by gradient
            continue
        stage, g = trainer.pipe.stages[s], p.grad
        g = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        if name in stage.ep_shards:
            g = gather_full(g, stage.ep_shards[name], trainer.checkpointable.splits.ep)
        out[stage.tied.get(name, name)] = g
    return out


def train_recording_gradients(rank: int, world: int, out: Path, cases: list) -> None:
    from pipetrain.train.trainer import Trainer

    for name, config, plan in cases:
        trainer = Trainer(config, plan, out / name)
        losses, grads = [], []
        for _ in range(STEPS):
            losses.append(trainer.train_step().loss)
            grads.append(full_gradients(trainer))  # kept until the next step's zero_grad
        record = {"losses": losses, "grads": grads, "params": full_parameters(trainer)}
        torch.save(record, out / f"{name}.rank{rank}.pt")


@pytest.fixture(scope="module")
def aux_free_runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep-aux-free")
    built = []
    for name, extra in {"ep2": ["parallel.ep=2"], "ep1": []}.items():
        config = compose([*BASE, *LAYOUT, *AUX_FREE, *extra])
        built.append((name, config, make_plan(config)))
    spawn(train_recording_gradients, 4, out, built)
    return out


@pytest.mark.parametrize("rank", range(4))
def test_ep2_equals_ep1_under_aux_free(aux_free_runs, rank):
    ep2, ep1 = (torch.load(aux_free_runs / f"{n}.rank{rank}.pt") for n in ("ep2", "ep1"))
    assert max(abs(a / b - 1) for a, b in zip(ep2["losses"], ep1["losses"])) < 1e-6, (ep2["losses"], ep1["losses"])
    for step, (got, ref) in enumerate(zip(ep2["grads"], ep1["grads"]), 1):
        assert set(got) == set(ref) and got, step
        for name, g in got.items():
            assert float((g - ref[name]).norm() / ref[name].norm()) < 1e-5, (step, name)
    biases = [n for n in ep1["params"] if n.endswith("expert_bias")]
    assert biases and all(ep1["params"][n].abs().max() > 0 for n in biases)  # the biases moved
    for name in biases:
        assert torch.equal(ep2["params"][name], ep1["params"][name]), name
