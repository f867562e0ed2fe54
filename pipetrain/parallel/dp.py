"""How one rank's stages become data parallel, from the config and the rank's groups.

  dp_replicate only   stages stay plain modules; the reducer is one bucketed all-reduce per
                      stage per step (runtime/grad_reduce.py).
  dp_shard (or HSDP)  every stage is FSDP2-sharded (parallel/fsdp.py) and reduce-scattered
                      once per stage per step.

Either way the executor calls the reducer at the schedule's REDUCE_GRAD marks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pipetrain.parallel.mesh import RankGroups
from pipetrain.runtime.batch import Batch
from pipetrain.runtime.grad_reduce import BucketAllReduce, GradReducer

if TYPE_CHECKING:
    from pipetrain.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DataParallel:
    groups: RankGroups
    reduce_dtype: torch.dtype
    param_dtype: Optional[torch.dtype]  # FSDP2's compute / all-gather dtype (None: the parameters')

    @property
    def sharded(self) -> bool:
        return self.groups.layout.dp_mode in ("shard", "hsdp")

    def wrap(self, stage: nn.Module) -> nn.Module:
        """The stage as the executor runs it: FSDP2-sharded under dp_shard, else itself."""
        if not self.sharded:
            return stage
        from pipetrain.parallel.fsdp import shard_stage  # torch's FSDP2 costs ~0.5 s to import

        from pipetrain.parallel.ep import expert_modules

        mesh = self.groups.fsdp_mesh
        assert mesh is not None
        return shard_stage(stage, mesh, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                           experts=expert_modules(stage), experts_mesh=self.groups.experts_mesh,
                           dp=self.groups.layout.dp * self.groups.layout.cp)

    def reducer(self, stages: dict[int, nn.Module]) -> GradReducer:
        if self.sharded:
            from pipetrain.parallel.fsdp import FsdpReduce

            return FsdpReduce(stages)
        return BucketAllReduce(stages, group=self.groups.dp_group, size=self.groups.layout.dp,
                               reduce_dtype=self.reduce_dtype)


def data_parallel(config: Config, groups: RankGroups) -> Optional[DataParallel]:
    """None without data (or context) parallel: everything as a single pipeline."""
    if groups.layout.dp_mode == "none":
        return None
    par = config.parallel
    param = par.param_dtype or ("bfloat16" if config.trainer.precision == "bf16" else None)
    return DataParallel(groups, DTYPES[par.reduce_dtype], DTYPES[param] if param else None)




def local_rows(batch: Batch, dp_index: int, dp: int) -> Batch:
    """Pipeline `dp_index`'s rows of the global batch: the dp_index-th of dp equal slices (views).
    The global batch of step k stays a function of (seed, k), whatever the dp degree."""
    if dp == 1:
        return batch
    x, y = batch
    if x.shape[0] % dp:
        raise ValueError(f"data.batch_size={x.shape[0]} does not split over dp={dp} pipelines: "
                         f"set data.batch_size to a multiple of {dp}")
    per = x.shape[0] // dp
    return x[dp_index * per: (dp_index + 1) * per], y[dp_index * per: (dp_index + 1) * per]
