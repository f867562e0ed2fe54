"""A rank's parts of split weights <-> the unsplit tensors: checkpoints across tensor- and
expert-parallel degrees, and materializing a stage's parts (models/init.py: materialize).

Expert parallel (parallel/ep.py) splits stacked experts on their first dimension over the EP group
the way tensor parallel splits a weight over the tp group: an expert is saved whole under its
global index whatever ep was, and gathered, placed and kept as below with the EP group in place of
the tp group (ep > 1 with tp > 1 is refused, so a weight is split over one of them at most).

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
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from pipetrain.compat import local_shape_and_offset
from pipetrain.parallel.tp import Split, TPGroup, gather_full
from pipetrain.runtime.ep_comm import EPGroup
from pipetrain.runtime.stage_protocol import Stage


def _dtensor_type():
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


@dataclass(frozen=True)
class SplitWeights:
    """Canonical name -> how it is split (`Split`) over the tp group `g` (None: no tp), and, under
    expert parallel, the experts' splits over the EP group `ep`."""

    g: Optional[TPGroup]
    shards: Mapping[str, Split]
    ep: Optional[EPGroup] = None
    ep_shards: Mapping[str, Split] = field(default_factory=dict)

    @classmethod
    def of(cls, g: Optional[TPGroup], stages: Mapping[int, Stage], ep: Optional[EPGroup] = None) -> SplitWeights:
        shards = {m.tied.get(n, n): spec for m in stages.values() for n, spec in m.tp_shards.items()}
        experts = {m.tied.get(n, n): spec for m in stages.values() for n, spec in m.ep_shards.items()}
        return cls(g, shards, ep, experts)

    def split_names(self) -> set[str]:
        return {*self.shards, *self.ep_shards}

    def _split(self, name: str) -> tuple[Optional[Split], Any]:
        """How `name` is split and over which group (None, None: whole on this rank)."""
        if name in self.ep_shards:
            return self.ep_shards[name], self.ep
        return self.shards.get(name), self.g

    def full(self, name: str, t: torch.Tensor, *, holder_only: bool = False) -> Optional[torch.Tensor]:
        """Collective (dp shard group, then tp group): the unsplit tensor of `name` from this rank's `t`;
        holder_only: on tp rank 0 only (None on the others)."""
        dtensor = _dtensor_type()
        local = t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t
        split, group = self._split(name)
        assert split is not None, f"{name} is not split"
        return gather_full(local.detach(), split, group, holder_only=holder_only)

    def full_shape(self, name: str, t: torch.Tensor) -> torch.Size:
        """The unsplit shape of `name` held as `t` (an FSDP2 DTensor's shape is already whole over dp)."""
        shape = list(t.shape)
        split, _ = self._split(name)
        if split is not None:
            shape[split.dim] = split.size
        return torch.Size(shape)

    def block(self, name: str) -> Optional[tuple[int, int, int]]:
        """(0, start, stop): the experts this EP rank keeps of a stacked expert weight (one contiguous
        block of dim 0), so materializing can read just them; None for anything else (a tp slice is
        read whole: where its rows lie on disk depends on each family's layout, e.g. GPT-2's transposes)."""
        split = self.ep_shards.get(name)
        if split is None or self.ep is None or split.blocks != 1:
            return None
        index = split.index(self.ep.size, self.ep.rank)
        return split.dim, int(index[0]), int(index[-1]) + 1

    def keep_local(self, name: str, full: torch.Tensor, into: torch.Tensor) -> None:
        """Copy this rank's part of the unsplit `full` into `into` (a plain tensor or an FSDP2 DTensor):
        its tp slice if `name` is split, then its dp shard; the index is made on `full`'s device
        (index_select wants both on one). models/init.py: materialize fills a stage this way."""
        (split, group), mine = self._split(name), full
        if split is not None:
            assert group is not None, f"{name} is split but no group was given"
            mine = full.index_select(split.dim, split.index(group.size, group.rank, device=full.device))
        self.keep_shard(name, mine, into)

    def keep_shard(self, name: str, mine: torch.Tensor, into: torch.Tensor) -> None:
        """Copy `mine` (this rank's tp slice or experts of `name`) into `into`: under FSDP2 its dp shard."""
        dtensor = _dtensor_type()
        with torch.no_grad():
            if dtensor is not None and isinstance(into, dtensor):
                shape, offset = local_shape_and_offset(mine.shape, into.device_mesh, into.placements)
                part = mine[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                into.to_local().copy_(part)
            else:
                into.copy_(mine)
