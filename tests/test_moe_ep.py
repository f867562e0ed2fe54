"""Expert parallel x FSDP2 x pipeline on real gloo processes (8 ranks): equal to one process.

moe-tiny (8 experts, top-2, the auxiliary balance loss) at pp=2 x dp_shard=2 x ep=2: each rank keeps
4 of every MoE layer's 8 experts and exchanges tokens with its EP peer by all-to-all; experts are
FSDP2-sharded over their own (here one-rank) mesh with the whole dp as divide factor. Under 1f1b,
zbv (split backward: the all-to-all's backward runs inside B) and dualpipev (DualPipe's mirror; whole
stages, and node by node with every F&B pair's forward and backward interleaved, pipeline.fb_overlap=on:
FSDP2's parameters gathered by the reducer, issue #29), and interleaved 1F1B paired for the same overlap
(Megatron's combined 1F1B) the losses of steps 1-3 and the parameters after 3 clipped AdamW steps
equal a single process training on the same microbatches (test_tensor_parallel.py's bounds), and
ep=1 at the same layout too: no "gradients doubled with EP=2". Under balance=aux_free ep=2 against
ep=1 directly (issue #28): the losses of 3 steps within 1e-6 relative, every token routed alike with
no choice near a tie, every reduced gradient of every step within fp32's reassociation bound
(tests/_parity.py, which a planted 1.001 on one layer's expert gradients exceeds), and the router
biases moved by those steps bitwise equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import BASE, STEPS, assert_ranks_equal, assert_resumes, reference, train_spawned

from _dist import spawn
from _parity import assert_gradients_close, full_tensors, gradient_excess
from pipetrain.plan import make_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUT = ["model=moe-tiny", "pipeline.degree=2", "parallel.dp_shard=2"]
CASES = {"ep2-1f1b": ["parallel.ep=2", "schedule=1f1b"], "ep2-zbv": ["parallel.ep=2", "schedule=zbv"],
         "ep2-dualpipev": ["parallel.ep=2", "schedule=dualpipev", "pipeline.fb_overlap=off"],
         "ep2-dualpipev-overlap": ["parallel.ep=2", "schedule=dualpipev", "pipeline.fb_overlap=on"],
         # combined 1F1B: schedules/lower.py pair_fb pairs interleaved 1F1B's steady state (execution.pairs_fb)
         "ep2-interleaved-overlap": ["parallel.ep=2", "schedule=interleaved_1f1b", "pipeline.fb_overlap=on"],
         "ep1-1f1b": ["schedule=1f1b"]}
# bias steps of +-0.01: every bias ends nonzero, and equal bits need equal sign(mean - count) per expert and step.
# Seed 13: at init the router's scores are close to uniform (1/8, std 0.025), so over the ~3,000 routing choices
# of 3 steps some K-th and (K+1)-th scores come close; the default seed's closest was 9e-7 apart while the
# two runs' scores differ by up to 9.5e-7 (ATEN_CPU_CAPABILITY=default): a flip there is rounding. Seed 13's
# closest is 1.9e-5 apart (the widest of seeds 1-44), which assert_same_routing checks on every run.
AUX_FREE = ["schedule=1f1b", "model.moe.balance=aux_free", "model.moe.bias_update_rate=0.01", "trainer.seed=13"]


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


def record_routing(trainer) -> list:
    """Hooks every router of this rank's stages: each forward appends (ids (T, K), biased scores (T, E))."""
    from pipetrain.models.moe_router import Router

    routes = []

    def hook(router, args, routing):
        routes.append((routing.ids.detach().clone(), (routing.scores.detach() + router.expert_bias).clone()))

    for stage in trainer.pipe.stages.values():
        for module in stage.modules():
            if isinstance(module, Router):
                module.register_forward_hook(hook)
    return routes


def train_recording_gradients(rank: int, world: int, out: Path, cases: list) -> None:
    from pipetrain.train.trainer import Trainer

    for name, config, plan in cases:
        trainer = Trainer(config, plan, out / name)
        routes = record_routing(trainer)
        losses, grads, routing = [], [], []
        for _ in range(STEPS):
            losses.append(trainer.train_step().loss)
            grads.append(full_tensors(trainer, grads=True))  # kept until the next step's zero_grad
            routing.append(routes[:])
            routes.clear()
        record = {"losses": losses, "grads": grads, "routing": routing, "params": full_tensors(trainer)}
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


def assert_same_routing(got: list, ref: list) -> None:
    """Every token chose the same experts in every router forward of every step, and no choice was
    within 4x the two runs' score difference of a tie (else a flip would be rounding, not a bug:
    AUX_FREE's seed says why it is 13)."""
    margins, deviation = [], 0.0
    for step, (g, r) in enumerate(zip(got, ref), 1):
        assert len(g) == len(r), (step, len(g), len(r))
        for i, ((ids, scores), (ref_ids, ref_scores)) in enumerate(zip(g, r)):
            assert torch.equal(ids, ref_ids), f"step {step}, router forward {i}: tokens chose other experts"
            k = ref_ids.shape[1]
            top = ref_scores.topk(k + 1, dim=-1).values  # (T, K + 1): the K-th choice against the first left out
            margins.append(float((top[:, k - 1] - top[:, k]).min()))
            deviation = max(deviation, float((scores - ref_scores).abs().max()))
    assert min(margins) > 4 * deviation, (f"a routing choice within {min(margins):.2e} of a tie against scores that "
                                          f"differ by {deviation:.2e}: pick a trainer.seed whose choices are not ties")


@pytest.mark.parametrize("rank", range(4))
def test_ep2_equals_ep1_under_aux_free(aux_free_runs, rank):
    ep2, ep1 = (torch.load(aux_free_runs / f"{n}.rank{rank}.pt") for n in ("ep2", "ep1"))
    assert max(abs(a / b - 1) for a, b in zip(ep2["losses"], ep1["losses"])) < 1e-6, (ep2["losses"], ep1["losses"])
    assert_same_routing(ep2["routing"], ep1["routing"])
    assert_gradients_close(ep2["grads"], ep1["grads"], what=f"ep2 against ep1, rank {rank}")
    biases = [n for n in ep1["params"] if n.endswith("expert_bias")]
    assert biases and all(ep1["params"][n].abs().max() > 0 for n in biases)  # the biases moved
    for name in biases:
        assert torch.equal(ep2["params"][name], ep1["params"][name]), name


def test_the_gradient_bound_sees_an_expert_gradient_off_by_a_thousandth(aux_free_runs):
    """The error model is not so loose that it passes a real bug: one layer's expert gradients scaled
    by 1.001 at step 1 (a wrong divide factor, a token counted twice in 1,000) exceed the bound on
    every rank, by far more than the bound's own headroom."""
    for rank in range(4):
        ep2, ep1 = (torch.load(aux_free_runs / f"{n}.rank{rank}.pt") for n in ("ep2", "ep1"))
        got = dict(ep2["grads"][0])
        experts = sorted(n for n in got if ".mlp.experts." in n)
        assert experts, sorted(got)
        for name in experts:
            planted = {**got, name: got[name] * 1.001}
            assert gradient_excess(planted, ep1["grads"][0], 1)[name] > 4, (rank, name)
