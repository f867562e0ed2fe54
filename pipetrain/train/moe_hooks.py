"""What training adds to an MoE model's blocks: each block's aux loss averaged over the microbatches
as the loss is, and under model.moe.balance=aux_free the router biases moved before every optimizer
step from the step's token counts summed over the ranks with other tokens (dp x cp) (torchtitan's optimizer
pre-step hook); and the blocks' metrics of a step (metrics/names.py moe/)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.moe_block import moe_step_stats, set_aux_loss_scale, update_expert_biases


def attach_moe_hooks(stages: Sequence[nn.Module], optimizer: torch.optim.Optimizer, *, microbatches: int,
                     batch_group: Optional[dist.ProcessGroup],
                     sequence_group: Optional[dist.ProcessGroup] = None) -> None:
    """Scale each block's aux loss by 1/microbatches and move the aux_free biases before each step from
    the counts summed over `batch_group` (the ranks holding the same stages with other tokens: dp x cp) and
    `sequence_group` (the tp ranks under sequence parallel, each holding other positions)."""
    stages = list(stages)
    for stage in stages:
        set_aux_loss_scale(stage, 1.0 / microbatches)

    def moe_pre_step(*_: Any) -> None:  # returns None: Optimizer.step reads a returned value as new args
        update_expert_biases(stages, batch_group, sequence_group=sequence_group)

    optimizer.register_step_pre_hook(moe_pre_step)


def moe_stats(stages: Sequence[nn.Module]) -> dict[str, float]:
    """The step's MoE block metrics on this rank (before the optimizer's pre-step hook resets them)."""
    return moe_step_stats(list(stages))
