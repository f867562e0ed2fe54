"""Checkpoints across tensor-parallel degrees: tp slices <-> the unsplit tensors.

A tensor-parallel rank holds slices of its split weights (and of their AdamW moments) under the
unsplit names. A checkpoint keeps the unsplit tensor under that name, whatever the degrees,
so a run saved at tp=2 loads at tp=1 (or any tp, pp, dp): on save every tp rank gathers each
split weight (first over FSDP2's dp shards, then to tp rank 0, by the indices each rank holds:
GPT-2's c_attn slices are three blocks, q, k and v of the same heads) and tp rank 0 hands DCP the
whole tensor (the other tp ranks offer nothing under that key; with data-parallel replicas DCP
writes it once, every replica's tp rank 0 offering the same key); on load each rank reads the
whole tensor and keeps its slice (and, under FSDP2, its dp shard of that slice).

Cost: DCP's save needs its state dict at once, so tp rank 0 holds the stage's split weights and
moments unsplit while saving (the other tp ranks only their slices). Writing DTensor shards instead
(torchtitan's _StridedShard for FSDP x TP on one dimension) would avoid even that; not done yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import nn

from pipetrain.parallel.tp import TPGroup, gather_full


def _dtensor_type():
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


@dataclass(frozen=True)
class TPShards:
    """Canonical name -> (split dimension, unsplit indices this tp rank holds), and the group."""

    g: TPGroup
    shards: Mapping[str, tuple[int, torch.Tensor]]

    @classmethod
    def of(cls, g: TPGroup, stages: Mapping[int, nn.Module]) -> TPShards:
        shards = {getattr(m, "tied", {}).get(n, n): spec for m in stages.values()
                  for n, spec in getattr(m, "tp_shards", {}).items()}
        return cls(g, shards)

    def full(self, name: str, t: torch.Tensor, *, holder_only: bool = False) -> Optional[torch.Tensor]:
        """Collective (dp shard group, then tp group): the unsplit tensor of `name` from this rank's `t`;
        holder_only: on tp rank 0 only (None on the others)."""
        dtensor = _dtensor_type()
        local = t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t
        dim, index = self.shards[name]
        return gather_full(local.detach(), dim, index, self.g, holder_only=holder_only)

    def full_shape(self, name: str, t: torch.Tensor) -> torch.Size:
        dim, _ = self.shards[name]
        shape = list(t.shape)
        shape[dim] *= self.g.size
        return torch.Size(shape)

    def keep_local(self, name: str, full: torch.Tensor, into: torch.Tensor) -> None:
        """Copy this rank's slice of the unsplit `full` into `into` (a plain tensor or an FSDP2 DTensor)."""
        dim, index = self.shards[name]
        mine = full.index_select(dim, index)
        dtensor = _dtensor_type()
        with torch.no_grad():
            if dtensor is not None and isinstance(into, dtensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offset = compute_local_shape_and_global_offset(mine.shape, into.device_mesh, into.placements)
                part = mine[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                into.to_local().copy_(part)
            else:
                into.copy_(mine)
