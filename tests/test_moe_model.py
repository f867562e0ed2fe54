"""MoE Llama-family models through the pipeline: build on meta, materialize per stage, train.

`model=moe-tiny` is llama-tiny's attention with an MoE MLP in every block (models/moe_block.py).
Pure: a meta-built model's stages hold the real model's weights and compute its logits; the
dense-first / frequency knobs place the MoE blocks; the aux loss's gradient reaches the routers
of every stage through the block output (AttachAuxLoss), with no executor change, and a
recomputed forward counts its tokens once. Dist (real gloo processes): pp=2 under 1f1b, zbh1
(B and W apart) and dualpipev trains as the single-process model does within 1e-5 for 3 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from _dist import spawn
from pipetrain.config.llama import LlamaModelConfig
from pipetrain.models.factory import build_model
from pipetrain.models.llama_costs import llama_param_count
from pipetrain.models.moe_block import AttachAuxLoss, moe_blocks, set_aux_loss_scale, update_expert_biases
from pipetrain.models.split import split_model
from pipetrain.parallel.parallelize import Parallelize
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.schedules import registry
from pipetrain.train.pipeline import Transport, build_rank_pipeline

REPO = Path(__file__).resolve().parents[1]
M, MB, SEQ, STEPS, LR = 4, 2, 16, 3, 0.1


def tiny_knobs(**moe) -> dict:
    """conf/model/moe-tiny.yaml's knobs at 4 blocks (a fast CPU step), model.moe.* overridden by `moe`."""
    raw = yaml.safe_load((REPO / "conf/model/moe-tiny.yaml").read_text())
    raw.pop("defaults")
    raw.update(num_hidden_layers=4)
    raw["moe"].update(moe)
    return LlamaModelConfig(**raw).knobs()


def batches(model, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [model.example_batch(microbatch=MB, seq=SEQ, generator=g) for _ in range(M)]


@pytest.mark.pure
def test_meta_built_stages_equal_the_real_model():
    knobs = tiny_knobs()
    real = build_model("llama", **knobs)
    with torch.device("meta"):
        meta = build_model("llama", **knobs)
    stages = split_model(meta, [range(0, 3), range(3, 6)], seed=0)
    x, _ = real.example_batch(microbatch=2, seq=SEQ, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](x)), real(x))
    assert float(stages[0].layers["1"].mlp.router.expert_bias.abs().sum()) == 0.0
    assert not stages[0].layers["1"].mlp.router.expert_bias.requires_grad  # the optimizer leaves it alone


@pytest.mark.pure
def test_dense_first_and_frequency_knobs_place_the_moe_blocks():
    knobs = tiny_knobs(first_dense_layers=1, layer_freq=2)
    with torch.device("meta"):
        model = build_model("llama", **knobs)
    kinds = [type(model.layers[1 + i].mlp).__name__ for i in range(4)]
    assert kinds == ["MLP", "MoEBlock", "MLP", "MoEBlock"]  # block 0 dense first; then (i + 1) % 2 == 0
    assert [model.layers[1 + i].ep_plan() for i in range(4)] == [(), ("mlp.experts",), (), ("mlp.experts",)]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == llama_param_count(model.config)


def router_grads(knobs: dict, *, recompute: bool = False) -> tuple[float, dict[str, torch.Tensor], list[int]]:
    """One step of the executor on one rank holding two stages (interleaved 1F1B, P=1, v=2)."""
    with torch.device("meta"):
        model = build_model("llama", **knobs)
    sched = registry.build("interleaved_1f1b", 1, M, 2)
    rp = build_rank_pipeline(model, uniform_bounds(len(model.layers), 2), sched, 0, microbatch_size=MB, seq_len=SEQ,
                             seed=0, parallelize=Parallelize(recompute=recompute))
    assert sum(set_aux_loss_scale(s, 1.0 / M) for s in rp.stages.values()) == 4
    res = rp.train_step(batches(model, 0))
    grads = {n: p.grad.clone() for _, n, p in rp.named_parameters() if n.endswith("router.weight")}
    counts = [int(b.tokens_per_expert.sum()) for s in rp.stages.values() for _, b in moe_blocks(s)]
    return res.loss, grads, counts


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.pure
def test_aux_loss_gradient_reaches_routers_on_every_stage():
    loss_aux, aux, counts = router_grads(tiny_knobs(balance="aux_loss", aux_loss_coef=1.0))
    loss_none, none, _ = router_grads(tiny_knobs(balance="none"))
    _, recomputed, counts_rc = router_grads(tiny_knobs(balance="aux_loss", aux_loss_coef=1.0), recompute=True)
    assert loss_aux == loss_none  # the aux loss changes the gradient, not the reported loss
    assert len(aux) == 4 and {n.split(".")[1] for n in aux} == {"1", "2", "3", "4"}  # both stages' blocks
    for n in aux:
        assert (aux[n] - none[n]).abs().max() > 1e-4, n  # balance gradient arrived in this block's router
        torch.testing.assert_close(recomputed[n], aux[n], atol=1e-6, rtol=0)
    assert counts == counts_rc == [M * MB * SEQ * 2] * 4  # top-2: each token twice, recompute not counted again


@pytest.mark.pure
def test_attach_aux_loss_is_the_gradient_of_the_scaled_sum():
    out = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(2, requires_grad=True)
    AttachAuxLoss.apply(out, (w ** 2).sum(), 0.25).sum().backward()
    torch.testing.assert_close(w.grad, 0.25 * 2 * w.detach())
    torch.testing.assert_close(out.grad, torch.ones(3, 4))


@pytest.mark.pure
def test_aux_loss_scale_is_each_blocks_own():
    """A pipeline and its one-process reference in one process keep their own scale (it was process-wide)."""
    a, b = (build_model("llama", **tiny_knobs(balance="aux_loss")) for _ in range(2))
    assert set_aux_loss_scale(a, 0.5) == 4
    assert {blk.aux_loss_scale for _, blk in moe_blocks(a)} == {0.5}
    assert {blk.aux_loss_scale for _, blk in moe_blocks(b)} == {1.0}


@pytest.mark.pure
def test_aux_free_pre_step_hook_moves_biases_from_the_step_counts():
    knobs = tiny_knobs(balance="aux_free", bias_update_rate=0.5)
    model = build_model("llama", **knobs)
    for x, _ in batches(model, 0):
        model(x)
    blocks = [b for _, b in moe_blocks(model)]
    counts = [b.tokens_per_expert.clone() for b in blocks]
    assert update_expert_biases([model]) == 4
    for b, c in zip(blocks, counts):
        want = 0.5 * torch.sign(c.double().mean() - c.double())
        torch.testing.assert_close(b.router.expert_bias.double(), want)
        assert b.tokens_per_expert is None  # the step's statistics start again


def train_ranks(rank: int, world: int, out, knobs: dict, names: list[str]) -> None:
    results = {}
    for name in names:
        with torch.device("meta"):
            model = build_model("llama", **knobs)
        sched = registry.build(name, world, M, registry.get(name).fixed_stages_per_rank or 1)
        bounds = uniform_bounds(len(model.layers), sched.placement.num_chunks)
        rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=MB, seq_len=SEQ, seed=0,
                                 transport=Transport(timeout_s=60, in_order=True))
        for stage in rp.stages.values():
            set_aux_loss_scale(stage, 1.0 / M)
        opt = torch.optim.SGD(rp.parameters(), lr=LR, momentum=0.9)
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses.append(rp.train_step(batches(model, step)).loss)
            opt.step()
        results[name] = {"losses": losses, "params": [(n, p.detach().clone()) for _, n, p in rp.named_parameters()]}
        rp.close()
    torch.save(results, out / f"rank{rank}.pt")


def reference(knobs: dict):
    model = build_model("llama", **knobs)
    set_aux_loss_scale(model, 1.0 / M)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):  # the mean over microbatches, as the executor's (loss / M) sums
        opt.zero_grad(set_to_none=True)
        mean = torch.stack([model.loss(model(x), y) for x, y in batches(model, step)]).mean()
        mean.backward()
        losses.append(mean.item())
        opt.step()
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.dist
@pytest.mark.slow
def test_pp2_trains_as_the_single_process_model(tmp_path):
    knobs = tiny_knobs(balance="aux_loss", aux_loss_coef=0.1)
    names = ["1f1b", "zbh1", "dualpipev"]
    spawn(train_ranks, 2, tmp_path, knobs, names)
    losses, params = reference(knobs)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in names:
        seen = set()
        for r in range(2):
            got = per_rank[r][name]
            assert got["losses"] == pytest.approx(losses, abs=1e-5), (name, r)
            for n, p in got["params"]:
                torch.testing.assert_close(p, params[n], atol=1e-5, rtol=0, msg=f"{name} rank {r} {n}")
                seen.add(n)
        assert seen == set(params)


@pytest.mark.pure
@pytest.mark.parametrize("override, message", [
    ("model.moe.balance=sinkhorn", "model.moe.balance='sinkhorn' is unknown: choose one of aux_free, aux_loss, "
                                   "seq_aux_loss, none"),
    ("model.moe.layer_freq=0", "model.moe.layer_freq must be >= 1 (got 0)"),
    ("parallel.etp=3", "parallel.etp=3 must be 1 (experts whole) or parallel.tp=1"),
    ("model.moe.dense_layers=[3,99]", "model.moe.dense_layers names block 99 of a model with 8 blocks (0-7, "
                                      "model.num_hidden_layers=8): list blocks below 8"),
    ("model.moe.first_dense_layers=9", "model.moe.first_dense_layers=9 exceeds the model's 8 blocks"),
    ("model.moe.aux_loss_coef=nan", "model.moe.aux_loss_coef must be a finite number (got nan)"),
    ("model.moe.bias_update_rate=inf", "model.moe.bias_update_rate must be a finite number (got inf)"),
])
def test_bad_moe_knobs_fail_in_one_line_at_composition(compose, override, message):
    """What `pipetrain` prints before any rank starts (the CLI composes first)."""
    with pytest.raises(Exception) as err:
        compose(["model=moe-tiny", override])
    root = err.value
    while root.__cause__ is not None:  # OmegaConf wraps errors raised in __post_init__
        root = root.__cause__
    assert message in str(root) and "\n" not in str(root)


@pytest.mark.pure
def test_experts_without_tokens_stay_in_the_graph():
    """Under expert parallel a rank whose experts get no token must still run the reverse
    all-to-alls in backward: its (0, H) expert output has to be part of the graph."""
    from pipetrain.models.moe import Experts

    experts = Experts(4, hidden=8, intermediate=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(0, 8, requires_grad=True)
    y = experts(x, torch.zeros(4, dtype=torch.long))
    assert y.shape == (0, 8) and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and experts.w1.grad is not None and float(experts.w1.grad.abs().sum()) == 0.0


@pytest.mark.pure
def test_step_stats_name_the_blocks_and_measure_imbalance():
    from pipetrain.models.moe_block import moe_step_stats

    knobs = tiny_knobs(balance="aux_loss", capacity_factor=1.0)
    with torch.device("meta"):
        model = build_model("llama", **knobs)
    stages = split_model(model, [range(0, 3), range(3, 6)], seed=0)
    for x, _ in batches(model, 0):
        stages[1](stages[0](x))
    stats = moe_step_stats(stages)
    assert sorted({k.split("/")[1] for k in stats}) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    for i in range(4):
        assert stats[f"moe/layers.{i}/imbalance"] >= 1.0 and stats[f"moe/layers.{i}/aux_loss"] > 0
        assert 0 <= stats[f"moe/layers.{i}/dropped"] < 1 and stats[f"moe/layers.{i}/bias_abs_max"] == 0.0
