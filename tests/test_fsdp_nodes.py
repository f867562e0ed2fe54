"""FSDP2 under node-level execution (parallel/fsdp.py FsdpReduce.gather, issue #29), on 2 real gloo ranks.

Nodes call a stage's submodules, not the stage, so FSDP2's forward hooks never run: the reducer's
`gather` makes the stage the root, unshards every group and registers the fold that FSDP2's
post-backward would do. Here a layer of a bf16 (param_dtype) stage is called the way a node calls it
(its forward, no hooks) for three microbatches: after each backward no bf16 gradient is left on the
unsharded parameters and the reduce-dtype (fp32) sum equals the fp32 sum of the three bf16 gradients
exactly; without the fold they would be summed in bf16.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn

pytestmark = pytest.mark.dist


def fold_rank(rank: int, world: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.compat import fsdp_param_groups
    from pipetrain.models.split import split_model
    from pipetrain.parallel.fsdp import FsdpReduce, shard_stage
    from test_nodes import tiny_moe

    model = tiny_moe(layers=2)
    (stage,) = split_model(model, [range(0, len(model.layers))])
    mesh = init_device_mesh("cpu", (world,))
    shard_stage(stage, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reducer = FsdpReduce({0: stage})
    reducer.begin()
    reducer.gather()
    layer = stage.layers["1"]  # an MoE decoder block: its own FSDP2 group
    params = [p for p in layer.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.bfloat16 and type(p) is torch.nn.Parameter for p in params)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(2, 8, 32, generator=g).bfloat16() for _ in range(3)]
    want = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for x in xs:  # each microbatch's own bf16 gradients, summed in fp32
        for w, gr in zip(want, torch.autograd.grad(layer.forward(x).float().sum(), params, allow_unused=True)):
            if gr is not None:
                w += gr.float()
    for x in xs:
        layer.forward(x).float().sum().backward()  # as a node runs it: no FSDP hook
        assert all(p.grad is None for p in params), "each bf16 gradient folds into the fp32 sum at once"
    group = next(gr for gr in fsdp_param_groups(stage) if any(fp.unsharded_param is params[0] for fp in gr.fsdp_params))
    got = {id(fp.unsharded_param): fp.unsharded_accumulated_grad for fp in group.fsdp_params}
    for p, w in zip(params, want):
        acc = got[id(p)]
        assert acc is not None and acc.dtype == torch.float32
        assert torch.equal(acc, w)
    torch.save({"ok": True}, out / f"rank{rank}.pt")


def test_gathered_fsdp2_layers_fold_bf16_gradients_into_fp32(tmp_path):
    spawn(fold_rank, 2, tmp_path)
    for r in range(2):
        assert torch.load(tmp_path / f"rank{r}.pt")["ok"]
