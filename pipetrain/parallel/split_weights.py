"""A rank's parts of split weights <-> the unsplit tensors: checkpoints across tensor- and
expert-parallel degrees, and materializing a stage's parts (models/init.py: materialize).

Expert parallel (parallel/ep.py) splits stacked experts on their first dimension over the EP group
the way tensor parallel splits a weight over the tp group: an expert is saved under its global
index whatever ep was. Under expert tensor parallel (etp = tp) a stacked expert weight is split over
both, experts on dim 0 over ep and each expert's width over tp: its boxes are the product of both.

A tensor-parallel rank holds slices of its split weights (and of their AdamW moments) under the
unsplit names. A checkpoint keeps the unsplit tensor under that name, whatever the degrees, so a
run saved at tp=2 loads at tp=1 (or any tp, pp, dp, ep). It is written and read as shards, as DCP
does with DTensors, and no rank ever holds more than its own slices: `parts` describes what this
rank holds of the unsplit tensor as boxes (offsets and sizes in the unsplit tensor, each a view of
the local tensor): one per block of its tp slice (GPT-2's c_attn: q, k and v of the same heads),
cut further to its dp shard under FSDP2. DCP writes each box as a chunk of the unsplit tensor
(replicas offer the same boxes and DCP writes them once) and, on load, reads into each box the
bytes of the chunks saved at any degrees that overlap it (train/checkpoint.py: the planners that
find a box by its offsets).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from pipetrain.compat import local_shape_and_offset
from pipetrain.parallel.tp import Split, TPGroup
from pipetrain.runtime.ep_comm import EPGroup
from pipetrain.runtime.stage_protocol import Stage
from pipetrain.runtime.sync import dtensor_type


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

    def _splits(self, name: str) -> list[tuple[Split, Any]]:
        """How `name` is split and over which group, each split dimension once ([]: whole on this rank)."""
        out = [(self.ep_shards[name], self.ep)] if name in self.ep_shards else []
        return out + ([(self.shards[name], self.g)] if name in self.shards else [])

    def parts(self, name: str, t: torch.Tensor, *, copy: bool = False) -> LocalParts:
        """What this rank's `t` (its slice of `name`, or of one of its AdamW moments; a plain tensor or
        an FSDP2 DTensor) holds of the unsplit tensor, as views of t's local data; copy=True: of a
        copy of it in host memory (an async save writes it while training goes on)."""
        splits = self._splits(name)
        assert splits and all(group is not None for _, group in splits), f"{name} is not split"
        runs = [[(0, 0, n)] for n in t.shape]  # per dimension: (start in t, start in the unsplit tensor, length)
        for split, group in splits:
            runs[split.dim] = split.runs(group.size, group.rank)
        dtensor = dtensor_type()
        local = t.detach()
        if dtensor is not None and isinstance(t, dtensor):  # its dp shard of the tp slice (t.shape is the slice's)
            shape, offset = local_shape_and_offset(t.shape, t.device_mesh, t.placements)
            runs = [_clip(r, o, n) for r, o, n in zip(runs, offset, shape)]
            local = local.to_local()
        return LocalParts(local.to("cpu", copy=True) if copy else local, self.full_shape(name, t), runs)

    def full_shape(self, name: str, t: torch.Tensor) -> torch.Size:
        """The unsplit shape of `name` held as `t` (an FSDP2 DTensor's shape is already whole over dp)."""
        shape = list(t.shape)
        for split, _ in self._splits(name):
            shape[split.dim] = split.size
        return torch.Size(shape)

    def block(self, name: str) -> Optional[tuple[int, int, int]]:
        """(0, start, stop): the experts this EP rank keeps of a stacked expert weight (one contiguous
        block of dim 0), so materializing can read just them; None for anything else (a tp slice is
        read whole: where its rows lie on disk depends on each family's layout, e.g. GPT-2's transposes)."""
        split = self.ep_shards.get(name)
        if split is None or self.ep is None or split.blocks != 1 or name in self.shards:  # etp: read whole
            return None
        index = split.index(self.ep.size, self.ep.rank)
        return split.dim, int(index[0]), int(index[-1]) + 1

    def keep_local(self, name: str, full: torch.Tensor, into: torch.Tensor) -> None:
        """Copy this rank's part of the unsplit `full` into `into` (a plain tensor or an FSDP2 DTensor):
        its tp slice if `name` is split, then its dp shard; the index is made on `full`'s device
        (index_select wants both on one). models/init.py: materialize fills a stage this way."""
        mine = full
        for split, group in self._splits(name):
            assert group is not None, f"{name} is split but no group was given"
            mine = mine.index_select(split.dim, split.index(group.size, group.rank, device=full.device))
        self.keep_shard(name, mine, into)

    def keep_shard(self, name: str, mine: torch.Tensor, into: torch.Tensor) -> None:
        """Copy `mine` (this rank's tp slice or experts of `name`) into `into`: under FSDP2 its dp shard."""
        dtensor = dtensor_type()
        with torch.no_grad():
            if dtensor is not None and isinstance(into, dtensor):
                shape, offset = local_shape_and_offset(mine.shape, into.device_mesh, into.placements)
                part = mine[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                into.to_local().copy_(part)
            else:
                into.copy_(mine)


def _clip(runs: list[tuple[int, int, int]], start: int, length: int) -> list[tuple[int, int, int]]:
    """The runs of a dimension cut to [start, start + length) of the slice, renumbered from start."""
    out = []
    for at, to, n in runs:
        lo, hi = max(at, start), min(at + n, start + length)
        if hi > lo:
            out.append((lo - start, to + lo - at, hi - lo))
    return out


class LocalParts:
    """This rank's part of one unsplit tensor of shape `shape`, as DCP's planners see it: boxes
    (offsets and sizes in the unsplit tensor), each a view of `local` (the cartesian product over
    dimensions of `runs`: (start in local, start in the unsplit tensor, length)). DCP's own
    extension hooks (the ones DTensor implements) write each box as a chunk and read the chunks
    a box overlaps; train/checkpoint.py's planners find a box by its offsets."""

    def __init__(self, local: torch.Tensor, shape: torch.Size, runs: list[list[tuple[int, int, int]]]) -> None:
        self.local, self.shape = local, torch.Size(shape)
        self.boxes: dict[tuple[int, ...], tuple[tuple[int, ...], torch.Tensor]] = {}
        for box in itertools.product(*runs):
            view = local[tuple(slice(at, at + n) for at, _, n in box)]
            self.boxes[tuple(to for _, to, _ in box)] = (tuple(n for _, _, n in box), view)

    def size(self) -> torch.Size:
        return self.shape

    def numel(self) -> int:
        return self.local.numel()

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                              properties=properties, size=self.shape))
                for offsets, (sizes, _) in self.boxes.items()]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for offsets, (sizes, _) in self.boxes.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.boxes[tuple(index.offset)][1]
