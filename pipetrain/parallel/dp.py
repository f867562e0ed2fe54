"""How one rank's stages become data parallel: the gradient reducer the executor calls at
each REDUCE_GRAD (replicas: runtime/grad_reduce.py's bucketed all-reduce)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipetrain.parallel.mesh import RankGroups
from pipetrain.runtime.grad_reduce import BucketAllReduce, GradReducer

if TYPE_CHECKING:
    from pipetrain.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def data_parallel_reducer(config: Config, groups: RankGroups) -> Callable[[dict[int, nn.Module]], GradReducer]:
    """A factory: the rank's stages -> their reducer over the rank's data-parallel group."""
    layout = groups.layout
    reduce_dtype = DTYPES[config.parallel.reduce_dtype]
    if layout.dp_shard > 1:
        raise NotImplementedError("parallel.dp_shard > 1 (FSDP2) is not wired yet")

    def build(stages: dict[int, nn.Module]) -> GradReducer:
        return BucketAllReduce(stages, group=groups.dp_group, size=layout.dp, reduce_dtype=reduce_dtype)

    return build
