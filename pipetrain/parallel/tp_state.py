"""Checkpoints across tensor-parallel degrees: tp slices <-> the unsplit tensors.

A tensor-parallel rank holds slices of its split weights (and of their AdamW moments) under the
unsplit names. A checkpoint keeps the unsplit tensor under that name, whatever the degrees,
so a run saved at tp=2 loads at tp=1 (or any tp, pp, dp): on save every tp rank gathers each
split weight (first over FSDP2's dp shards, then to tp rank 0, which places each rank's slice by
that rank's indices, computed where they are used: GPT-2's c_attn slices are three blocks, q, k
and v of the same heads; only the data crosses the group) and tp rank 0 hands DCP the
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

from pipetrain.compat import local_shape_and_offset
from pipetrain.parallel.tp import Split, TPGroup, gather_full
from pipetrain.runtime.stage_protocol import Stage


def _dtensor_type():
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


@dataclass(frozen=True)
class TPShards:
    """Canonical name -> how it is split over the tp group (`Split`), and the group (None: no tp)."""

    g: Optional[TPGroup]
    shards: Mapping[str, Split]

    @classmethod
    def of(cls, g: Optional[TPGroup], stages: Mapping[int, Stage]) -> TPShards:
        shards = {m.tied.get(n, n): spec for m in stages.values() for n, spec in m.tp_shards.items()}
        return cls(g, shards)

    def full(self, name: str, t: torch.Tensor, *, holder_only: bool = False) -> Optional[torch.Tensor]:
        """Collective (dp shard group, then tp group): the unsplit tensor of `name` from this rank's `t`;
        holder_only: on tp rank 0 only (None on the others)."""
        dtensor = _dtensor_type()
        local = t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t
        return gather_full(local.detach(), self.shards[name], self.g, holder_only=holder_only)

    def full_shape(self, name: str, t: torch.Tensor) -> torch.Size:
        """The unsplit shape of `name` held as `t` (an FSDP2 DTensor's shape is already whole over dp)."""
        shape = list(t.shape)
        split = self.shards.get(name)
        if split is not None:
            shape[split.dim] = split.size
        return torch.Size(shape)

    def keep_local(self, name: str, full: torch.Tensor, into: torch.Tensor) -> None:
        """Copy this rank's part of the unsplit `full` into `into` (a plain tensor or an FSDP2 DTensor):
        its tp slice if `name` is split, then its dp shard; the index is made on `full`'s device
        (index_select wants both on one). models/init.py: materialize fills a stage this way."""
        split, mine = self.shards.get(name), full
        if split is not None:
            assert self.g is not None, f"{name} is tp-split but no tp group was given"
            mine = full.index_select(split.dim, split.index(self.g.size, self.g.rank, device=full.device))
        dtensor = _dtensor_type()
        with torch.no_grad():
            if dtensor is not None and isinstance(into, dtensor):
                shape, offset = local_shape_and_offset(mine.shape, into.device_mesh, into.placements)
                part = mine[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                into.to_local().copy_(part)
            else:
                into.copy_(mine)
