"""AdamW's state as a resume of a tensor-parallel checkpoint leaves it (F11 of the CUDA/NCCL review).

A tp slice is read through its unsplit tensor, made on the CPU; its `step` must still land where
torch's own Optimizer.load_state_dict puts it: fp32 on the parameter's device for fused /
capturable AdamW (the fused CUDA kernel reads it there), as loaded otherwise. The parameters
are on the `meta` device, standing for CUDA ones (a CPU-only machine has no second device):
before the fix every split weight's step was made on the CPU beside its `like`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.parallel.tp import ColumnParallelLinear, RowParallelLinear, TPGroup, shard_layout
from pipetrain.parallel.split_weights import SplitWeights
from pipetrain.runtime.sync import GradSync
from pipetrain.train.checkpoint import Checkpointable, TrainState, _load_targets, _restore

pytestmark = pytest.mark.pure


def tp_stage(device: str) -> nn.Module:
    """tp rank 0 of 2: a column- and a row-parallel linear (with biases) and a whole norm."""
    g = TPGroup(None, 2, 0)
    stage = nn.ModuleDict({"fc": ColumnParallelLinear(nn.Linear(4, 8, device=device), g),
                           "proj": RowParallelLinear(nn.Linear(8, 4, device=device), g),
                           "norm": nn.LayerNorm(4, device=device)})
    stage.tp_shards, stage.tied = shard_layout(stage), {}  # what GradSync reads of a stage (runtime/stage_protocol.py)
    return stage


@pytest.mark.parametrize("device, kind", [("meta", "capturable"), ("cpu", "fused"), ("cpu", "plain")])
def test_resumed_step_where_torch_load_state_dict_puts_it(device, kind):
    stage = tp_stage(device)
    opt = torch.optim.AdamW(stage.parameters(), **({kind: True} if kind != "plain" else {}))
    target = Checkpointable(GradSync({0: stage}), opt, TrainState(), SplitWeights(TPGroup(None, 2, 0), stage.tp_shards))
    targets, adam = _load_targets(target, available=set(_all_keys(target)))
    on_device = kind != "plain"
    for name, p in ((n, ps[0]) for n, ps in target.sync.local.items()):
        want = p.device if on_device else torch.device("cpu")
        assert adam[name]["step"].device == want, (name, adam[name]["step"].device)
    _restore(target, targets, adam)
    theirs = torch.optim.AdamW(stage.parameters(), **({kind: True} if kind != "plain" else {}))
    theirs.load_state_dict(opt.state_dict())  # torch's own rule for where each state goes
    for p in stage.parameters():
        for key, t in opt.state[p].items():
            ref = theirs.state[p][key]
            assert (t.device, t.dtype, t.shape) == (ref.device, ref.dtype, ref.shape), (key, p.shape)
        assert opt.state[p]["exp_avg"].shape == p.shape and opt.state[p]["exp_avg"].device == p.device


def _all_keys(target: Checkpointable) -> list[str]:
    """The keys a checkpoint of this model holds (what _load_targets asks DCP for)."""
    names = sorted(target.sync.local)
    return [f"model.{n}" for n in names] + [f"optim.{k}.{n}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")]
