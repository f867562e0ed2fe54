"""Node-level execution of a stage (runtime/nodes.py, issue #29): a stage run node by node (the
executor's serial node mode: the forward and backward of every node through runtime/backward.py,
B and W kept apart where the schedule splits them) equals the same stage run whole within 1e-6
relative: the losses and every gradient. moe-tiny-like Llama (MoE blocks, a dense block, the aux
balance loss, a shared expert) under DualPipe-V at pp=1 (both V stages on the one rank: F&B pairs,
B/W split at the end) and zbh1-free 1F1B on one process."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models.llama import Llama
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.overlap import NodeExecution, fb_order, stage_passes
from pipetrain.runtime.stage_passes import WholeStages
from pipetrain.schedules import registry
from pipetrain.models.split import split_model

pytestmark = pytest.mark.pure

M, MB, SEQ = 4, 2, 8
MOE = dict(num_experts=4, top_k=2, intermediate_size=16, balance="aux_loss", aux_loss_coef=0.01,
           num_shared_experts=1, dense_layers=[1])


def tiny_moe(layers: int = 4, seed: int = 0, **moe) -> Llama:
    return Llama(seed=seed, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 moe={**MOE, **moe})


def microbatches(step: int = 0):
    g = torch.Generator().manual_seed(10 + step)
    return [(torch.randint(0, 64, (MB, SEQ), generator=g), torch.randint(0, 64, (MB, SEQ), generator=g))
            for _ in range(M)]


def run(schedule: str, fb_overlap: str):
    model = tiny_moe()
    sched = registry.build(schedule, 1, M, 2)
    stages = dict(enumerate(split_model(model, uniform_bounds(len(model.layers), sched.placement.num_chunks))))
    ex = Executor(sched, 0, stages, comm=None, fb_overlap=fb_overlap)
    res = ex.step(microbatches())
    return res.loss, {f"{s}:{n}": p.grad for s, st in stages.items() for n, p in st.named_parameters()}


@pytest.mark.parametrize("schedule", ["dualpipev"])
def test_node_execution_equals_whole_stages(schedule):
    loss, grads = run(schedule, "off")
    nloss, ngrads = run(schedule, "serial")
    assert nloss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == ngrads.keys()
    for k, g in grads.items():
        assert (g is None) == (ngrads[k] is None), k
        if g is None:
            continue
        torch.testing.assert_close(ngrads[k], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=k)


def _steps(side: str, names: tuple[str, ...], layer: str):
    from pipetrain.runtime.stage_protocol import Node

    return [(Node(n, layer, (), ()), f"{side}.{n}") for n in names]


def test_fb_order_is_the_design_notes_for_moe_pairs_and_serial_otherwise():
    moe = ("attn", "dispatch", "experts", "combine", "post")
    f = [_steps("F", ("embed",), "0"), _steps("F", moe, "1"), _steps("F", moe, "3")]
    b = [_steps("B", moe[::-1], "4"), _steps("B", ("layer",), "2")]
    order = [s for _, s in fb_order(f, b)]
    assert order == ["F.embed", "B.post", "B.combine", "B.experts", "B.dispatch", "B.attn",  # embed vs MoE: serial
                     "F.attn", "F.dispatch", "F.experts", "F.combine", "F.post", "B.layer",  # MoE vs dense: serial
                     "F.attn", "F.dispatch", "F.experts", "F.combine", "F.post"]  # left over: serial
    pair = [s for _, s in fb_order([_steps("F", moe, "1")], [_steps("B", moe[::-1], "2")])]
    assert pair == ["B.post", "B.combine", "F.attn", "F.dispatch", "B.experts", "B.dispatch", "F.experts",
                    "F.combine", "B.attn", "F.post"]  # Megatron's: B.combine hides under F.attn


def test_fb_overlap_knob_refuses_in_one_line(monkeypatch):
    from pipetrain.config import PipelineConfig

    with pytest.raises(ValueError, match="pipeline.fb_overlap must be off or auto or on"):
        PipelineConfig(fb_overlap="yes")
    stages = dict(enumerate(split_model(tiny_moe(), uniform_bounds(6, 2))))
    cpu = torch.device("cpu")
    assert isinstance(stage_passes(stages, "off", cpu), WholeStages)
    assert isinstance(stage_passes(stages, "auto", cpu), WholeStages), "no all-to-all to hide (ep=1): whole stages"
    assert isinstance(stage_passes(stages, "serial", cpu), NodeExecution)
    assert stage_passes(stages, "on", cpu).interleave
    stages[1].checkpoint_layers = True
    with pytest.raises(ValueError, match="stage 1 cannot run node by node.*set pipeline.fb_overlap=auto or off"):
        stage_passes(stages, "on", cpu)
    stages[1].checkpoint_layers = False
    cuda = torch.device("cuda")  # nothing of CUDA is touched before these answers
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1 puts in one hardware queue.*fb_overlap=auto"):
        stage_passes(stages, "on", cuda)
    assert isinstance(stage_passes(stages, "auto", cuda), WholeStages), "one hardware queue: whole stages"
    assert stage_passes(stages, "on", cpu).stream is None
