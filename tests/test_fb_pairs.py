"""The F&B overlap model of an MoE layer pair (schedules/fb_pairs.py, issue #29): the executor's node order
priced on one thread (`chain_ms`), per layer in the simulator (StageCosts.layers), and the planner's split of
a layer's totals into nodes (plan.overlap_layers). Pure: hand-timed examples."""

from __future__ import annotations

import pytest

from pipetrain.compose import compose_config
from pipetrain.plan import layer_costs, layout_inputs, make_partition, overlap_layers
from pipetrain.schedules import registry
from pipetrain.schedules.fb_pairs import PAIR_ORDER, LayerNodes, PassNodes, chain_ms, pair_saving
from pipetrain.schedules.ir import Action, Op, Overlap
from pipetrain.schedules.simulate import StageCosts

pytestmark = pytest.mark.pure

# attn 4, experts 3, post 1 ms; every all-to-all 2 ms (test_chain_...) or 5 ms (the pair tests)
NODES = dict(attn=4.0, experts=3.0, post=1.0)


def test_chain_model_of_an_moe_layer_pair():
    """One thread runs the pair's nodes in order; a compute node waits for its side's last all-to-all;
    two all-to-alls fly at once. Hand-timed: attn 4, experts 3, post 1 ms, every all-to-all 2 ms."""
    ms = {**NODES, "dispatch": 2.0, "combine": 2.0}
    pairs = lambda order: [(o[0], o[2:]) for o in order.split()]  # noqa: E731
    # F.attn first leaves B.combine's 2 ms nothing to hide behind: 18 of 24 serial ms
    assert chain_ms(ms, ms, pairs("F.attn B.post B.combine F.dispatch B.experts B.dispatch F.experts F.combine "
                                  "B.attn F.post")) == 18
    # Megatron's order (B.combine under F.attn) hides every all-to-all: the 16 ms of compute
    assert chain_ms(ms, ms) == 16 and list(PAIR_ORDER) == pairs(
        "B.post B.combine F.attn F.dispatch B.experts B.dispatch F.experts F.combine B.attn F.post")
    assert chain_ms(ms, ms, pairs("F.attn F.dispatch F.experts F.combine F.post")) == 4 + 2 + 3 + 2 + 1


def test_stage_costs_price_an_fb_pair_as_the_node_chain():
    """Stage 0 = [dense, MoE], stage 1 = [MoE, dense] (DualPipe-V's mirror): F(0) & B|BW(1) pairs forward
    layer i with backward layer 1 - i, so dense with dense (serial: saves nothing) and MoE with MoE.
    The MoE pair, all-to-alls 5 ms: with a B, 19 ms of 36 serial; with a BW, whose W = 8 goes onto B's
    attn, experts and post as 4:3:1 (to 8, 6, 2), 27 of 44 serial: 17 ms saved either way."""
    moe_f = PassNodes(NODES["attn"], 5.0, NODES["experts"], 5.0, NODES["post"])
    moe, dense = LayerNodes(moe_f, moe_f, w=8.0), LayerNodes(PassNodes(attn=6.0), PassNodes(attn=6.0), w=2.0)
    bw = moe.backward(with_w=True)
    assert bw == PassNodes(8.0, 5.0, 6.0, 5.0, 2.0) and sum(bw) == sum(moe.b) + moe.w
    # by hand, the BW pair: B.post 0-2, B.combine lands 7, F.attn 2-6, F.dispatch lands 11, B.experts 7-13,
    # B.dispatch lands 18, F.experts 13-16, F.combine lands 21, B.attn 18-26, F.post 26-27
    assert chain_ms(moe.f._asdict(), bw._asdict()) == 27
    # the B pair: B.post 0-1, F.attn 1-5, B.experts 6-9, F.experts 10-13, B.attn 14-18, F.post 18-19
    assert chain_ms(moe.f._asdict(), moe.b._asdict()) == 19
    # on one link (all-to-all times from bytes over a bandwidth) each waits for the one before: the four
    # run 1-6, 6-11, 11-16, 16-21 back to back, F.post 21-22
    assert chain_ms(moe.f._asdict(), moe.b._asdict(), one_link=True) == 22
    assert pair_saving(moe, moe, with_w=True) == 44 - 27 and pair_saving(moe, moe, with_w=False) == 36 - 19
    assert pair_saving(moe, dense, with_w=True) == 0 == pair_saving(dense, moe, with_w=True), "no a2a: serial"
    f, b, w = (30.0, 40.0), (31.0, 41.0), (12.0, 13.0)  # the actions' own times (recompute, overheads: serial)
    costs = StageCosts(f, b, w, layers=((dense, moe), (moe, dense)))
    for op, saved in ((Op.BW, 17.0), (Op.B, 17.0)):
        pair = Overlap(Action(Op.F, 0, 1), Action(op, 1, 0))
        assert costs.step(pair) == pytest.approx(costs.action(pair.forward) + costs.action(pair.backward) - saved)
        assert costs.step(pair, fb_overlap=0.5) == costs.step(pair), "the node model replaces the scalar"
    # the same stage on both sides pairs dense with MoE: nothing hidden
    same = Overlap(Action(Op.F, 0, 1), Action(Op.BW, 0, 0))
    assert costs.step(same) == costs.action(same.forward) + costs.action(same.backward)
    linked = StageCosts(f, b, w, layers=((dense, moe), (moe, dense)), one_link=True)
    pair = Overlap(Action(Op.F, 0, 1), Action(Op.B, 1, 0))
    assert costs.step(pair) - linked.step(pair) == pytest.approx(19 - 22)
    assert linked.with_recompute().one_link and linked.with_recompute().layers == linked.layers
    with pytest.raises(TypeError, match="LayerNodes"):
        StageCosts(f, b, w, layers=(((1.0, 1.0, 1.0, 1.0, 1.0),), ((1.0, 1.0, 1.0, 1.0, 1.0),)))


@pytest.mark.parametrize("shared", [0, 1])
def test_overlap_layers_split_each_layers_totals_into_nodes(shared):
    """plan.overlap_layers (mode=simulate, the planner): per MoE layer the nodes sum to its f and b, dispatch
    and combine halve its all-to-all, experts take the routed experts' FLOP share of the compute (moe-tiny:
    top-2 x 3 x 128 x 128 routed weights, 2 FLOPs each, of the block's forward FLOPs), post the shared
    experts' (with one shared expert of the same width: 3 x 128 x 128), w stays whole."""
    cfg = compose_config(["mode=simulate", "model=moe-tiny", "data.seq_len=64", "data.batch_size=8",
                          "pipeline.degree=2", "pipeline.microbatches=4", "parallel.dp_shard=2", "schedule=dualpipev",
                          "parallel.ep=2", "pipeline.fb_overlap=on", f"model.moe.num_shared_experts={shared}"])
    part = make_partition(cfg, layer_costs(cfg), 4)
    pl = registry.placement_for("dualpipev", 2, 2)
    per_stage = overlap_layers(layout_inputs(cfg, part, 4), pl)
    for s, stage in enumerate(per_stage):
        layers = [part.layers[i] for i in part.bounds[pl.chunk_of(s)]]
        assert len(stage) == len(layers)
        for nodes, l in zip(stage, layers):
            assert sum(nodes.f) == pytest.approx(l.f_ms, rel=1e-12) and sum(nodes.b) == pytest.approx(l.b_ms, rel=1e-12)
            assert (nodes.f.dispatch, nodes.f.combine, nodes.b.a2a, nodes.w) == pytest.approx(
                (l.comm_f_ms / 2, l.comm_f_ms / 2, l.comm_b_ms, l.w_ms))
            share = 2 * 2 * 3 * 128 * 128 / l.flops_per_token if l.a2a_values_per_token else 0.0
            post = shared * 2 * 3 * 128 * 128 / l.flops_per_token if l.a2a_values_per_token else 0.0
            assert nodes.f.experts == pytest.approx(share * (l.f_ms - l.comm_f_ms))
            assert (nodes.f.post == pytest.approx(post * (l.f_ms - l.comm_f_ms))
                    and (nodes.f.post > 0) == bool(shared and post))
            assert sum(nodes.backward(with_w=True)) == pytest.approx(l.b_ms + l.w_ms, rel=1e-12)
    assert sum(1 for stage in per_stage for n in stage if n.f.a2a) == 8, "moe-tiny's 8 blocks are MoE"
