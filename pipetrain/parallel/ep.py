"""Expert parallel inside a stage: each rank of an EP group keeps E/ep of every MoE layer's experts.

A layer declares where its stacked experts are (`ep_plan()`: module paths whose parameters are
(E, ...) tensors, one expert per row, and whose forward takes (rows sorted by expert, counts per
expert)). `shard_experts` keeps this rank's block of such a module's experts, rows
[i E/ep, (i+1) E/ep) of every stacked weight under the unsplit name, and declares the group on it
(`ep_group`), so the layer's forward sends each routed row to the rank holding its expert and back
(models/moe.py MoE.phases, over runtime/ep_comm.py): the router and the rest of the layer run on this
rank's tokens as before. No class is swapped: the module keeps its own.
The stage records the split (`ep_shards`: local name -> Split(0, E)) so materializing and
checkpoints hold and save experts by their global index (a run resumes at another ep).

Which ranks form the EP group is the layout's folding (parallel/layout.py: over dp_shard x cp, and tp
where parallel.etp = 1). Under data or context parallel the experts are FSDP2-sharded over their own
mesh, the expert-data-parallel ranks (parallel/mesh.py), and their gradients divided by dp x cp, not
that mesh's size: tokens of all ep ranks already summed into an expert's gradient (the "gradients
doubled with EP=2" bug class).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from pipetrain.parallel.layer_spec import ExpertsPlanned
from pipetrain.parallel.mesh import RankGroups
from pipetrain.parallel.tp import Split
from pipetrain.runtime.ep_comm import EPGroup


def shard_experts(experts: nn.Module, g: EPGroup) -> Split:
    """Keep rows [i E/ep, (i+1) E/ep) of every stacked weight of `experts` (on meta: shapes only)
    and declare the group on it (`ep_group`: its layer then dispatches and combines, models/moe.py);
    returns how its weights are split (Split(0, E))."""
    sizes = {p.shape[0] for p in experts.parameters()}
    if len(sizes) != 1 or next(iter(sizes)) % g.size:
        raise ValueError(f"parallel.ep={g.size} must divide the number of experts ({sorted(sizes)}): "
                         f"set parallel.ep to a divisor of it")
    num = sizes.pop()
    block = slice(g.rank * num // g.size, (g.rank + 1) * num // g.size)
    for name, p in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, nn.Parameter(p.detach()[block].clone(), requires_grad=p.requires_grad))
    experts.ep_group = g
    return Split(0, num)


def parallelize_experts(stage: nn.Module, g: EPGroup) -> nn.Module:
    """Split every declared stacked-experts module of the stage over the EP group, in place; sets
    `stage.ep_shards` (local parameter name -> Split(0, E))."""
    shards: dict[str, Split] = {}
    for key, layer in stage.layers.items():
        if not isinstance(layer, ExpertsPlanned):
            continue
        for path in layer.ep_plan():
            experts = layer.get_submodule(path)
            split = shard_experts(experts, g)
            shards.update({f"layers.{key}.{path}.{n}": split for n, _ in experts.named_parameters()})
    stage.ep_shards = shards
    return stage


def expert_modules(stage: nn.Module) -> list[nn.Module]:
    """The stage's stacked-experts modules split over the EP group (what FSDP2 shards over the EDP
    mesh): the owners of the parameters `stage.ep_shards` names, in order, each once."""
    paths = dict.fromkeys(name.rpartition(".")[0] for name in stage.ep_shards)
    return [stage.get_submodule(path) for path in paths]


def expert_parallel(groups: RankGroups) -> Optional[EPGroup]:
    """None without expert parallel (parallel.ep = 1)."""
    if groups.layout.ep == 1:
        return None
    return EPGroup(groups.ep_group, groups.layout.ep, groups.ep_index)
