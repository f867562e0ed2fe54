"""FSDP2 stages under the pipeline: sharded parameters, one reduce-scatter per stage per step.

`shard_stage` applies `fully_shard` to each layer of a stage (one all-gather / reduce-scatter
group per transformer block) and to the stage itself (the rest: norms, layers holding a
weight tied inside the stage), over the dp_shard mesh (HSDP: the 2-D ("dp_replicate",
"dp_shard") mesh), with `reshard_after_forward=False`: a stage's parameters are gathered at
its first forward of the step and stay whole until its gradients are reduced, so the step's
many microbatches never all-gather again (what torchtitan does under PP).

`FsdpReduce` is the executor's reducer (runtime/grad_reduce.py: GradReducer). At the start
of a step it turns FSDP's own gradient sync off (no communication in any B or W: FSDP's hooks
only accumulate, in fp32 under mixed precision); at the stage's REDUCE_GRAD it runs the
post-backward of every parameter group of the stage once (reduce-scatter; HSDP adds the
all-reduce over replicas), which reshards; at the end of the step it waits for all of them.
These are the calls torch.distributed.pipelining's `perform_reduce_grad` makes (torch 2.13).
FSDP2 averages over the data-parallel ranks, which with each pipeline's loss = mean over its
microbatches gives the mean over the global batch.

After the first forward of a step a stage's `parameters()` are the unsharded tensors the
graph uses (the executor reads them per step); between steps they are the sharded DTensors
the optimizer holds.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pipetrain.compat import fsdp_accumulate_in_reduce_dtype, fsdp_finish_backward, fsdp_lazy_init, fsdp_param_groups


def shard_stage(stage: nn.Module, mesh: DeviceMesh, *, param_dtype: Optional[torch.dtype],
                reduce_dtype: torch.dtype, experts: Sequence[nn.Module] = (),
                experts_mesh: Optional[DeviceMesh] = None, dp: int = 1) -> nn.Module:
    """`experts` (expert parallel: parallel/ep.py) are sharded first, over `experts_mesh` (the ranks
    holding the same experts), their gradients divided by `dp`, every rank with other tokens (dp x cp),
    not the mesh's size: every ep rank's tokens are already summed into them (torchtitan sets the same
    divide factor), so any folding averages as the dense weights do over dp x cp."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # weights no gradient reaches (an MoE router's aux_free bias, moved by its own rule before each
    # optimizer step) stay whole, plain tensors on every rank
    frozen = {p for p in stage.parameters() if not p.requires_grad} or None
    for module in experts:
        assert experts_mesh is not None, "expert parallel needs its experts' mesh"
        fully_shard(module, mesh=experts_mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=frozen)
        module.set_gradient_divide_factor(float(dp))
        # A factor other than the mesh's size is NCCL's PREMUL_SUM, which gloo has not: sum, then divide. Not
        # on a 1-rank mesh, where torch 2.13 divides in its copy and would divide again after it.
        if experts_mesh.device_type == "cpu" and experts_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
    tied = set(stage.tied)
    for name, layer in stage.layers.items():
        own = [n for n, _ in layer.named_parameters()]
        # A weight tied to another layer of this stage is one Parameter in two layers: the
        # stage's own group (below) must hold it, not either layer's.
        if own and not any(f"layers.{name}.{n}" in tied for n in own):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=frozen)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=frozen)
    return stage


class FsdpReduce:
    """Reduce-scatter each FSDP2 stage's gradients once per step, where the schedule says."""

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        for s, mod in stages.items():
            if not isinstance(mod, FSDPModule):
                raise TypeError(f"stage {s} is not sharded (parallel/fsdp.py: shard_stage)")
        self.stages = stages
        self.counts: Counter = Counter()
        self._reduced: list[int] = []
        self._folding = False  # node-level execution: gradients fold into fp32 as they accumulate (gather)

    def begin(self) -> None:
        for mod in self.stages.values():
            mod.set_requires_gradient_sync(False)
            mod.set_reshard_after_backward(False)
            mod.set_is_last_backward(False)

    def gather(self) -> None:
        """Node-level execution calls the stages' submodules, not the stages: FSDP2's pre-forward hooks,
        which would initialise the root and all-gather each group, do not run. So, before the step's
        first forward: the stage claims the root role (else the first hooked layer a node calls would),
        then every group of it unshards (the same all-gathers, up front; they stay whole until reduce).
        At the first gather each group's gradients start folding into fp32 as they accumulate (FSDP2's
        post-backward hook, which would, is bypassed too: compat.fsdp_accumulate_in_reduce_dtype)."""
        for mod in self.stages.values():
            fsdp_lazy_init(mod)
            for sub in mod.modules():
                if isinstance(sub, FSDPModule):
                    sub.unshard()
        if not self._folding:
            for mod in self.stages.values():
                for group in fsdp_param_groups(mod):
                    fsdp_accumulate_in_reduce_dtype(group)
            self._folding = True

    def reduce(self, stage: int) -> None:
        self.counts[stage] += 1
        mod = self.stages[stage]
        mod.set_is_last_backward(True)
        mod.set_reshard_after_backward(True)
        mod.set_requires_gradient_sync(True)
        for group in fsdp_param_groups(mod):
            group.post_backward()
        self._reduced.append(stage)

    def poll(self) -> list[int]:
        return []  # FSDP2 keeps its reduce-scatter's completion to itself: reported by finish

    def finish(self, done: Callable[[int], None] = lambda stage: None) -> None:
        reduced, self._reduced = self._reduced, []
        for s in reduced:
            fsdp_finish_backward(self.stages[s])
            done(s)

