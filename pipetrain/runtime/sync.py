"""Keep every copy of a parameter identical: sum gradients across copies before the step.

Copies arise two ways, and one mechanism serves both:
  - tied weights on different stages (GPT-2's embedding and output head), marked by
    `StageModule.tied` with the canonical unsplit name of the weight;
  - DualPipe's mirror, where two stages (on ranks r and P-1-r) hold the same chunk.
A parameter's *canonical name* is its tie group if tied, else its own (unsplit) name.
All copies of one canonical name, wherever they live, must end with the same gradient:
the sum over copies (each copy saw a different part of the work). Per rank: sum local
copies, all-reduce over the ranks that hold one (a subgroup per distinct set of
holders, gradients flattened into one buffer per set), write the sum back to every copy (a
weight with one copy on this rank takes its part of the reduced buffer as its gradient, as
runtime/grad_reduce.py's replicas do: no copy back).
Identical gradients + identical optimizer state keep the copies identical step after step.

Under data parallel each pipeline does this among its own ranks (`group`: the pipeline's
group, `pipelines`: every pipeline's global ranks, so every rank creates every pipeline's
subgroups in one order), after each stage's gradients were reduced over data parallel
(runtime/grad_reduce.py): reduce over dp, then sum the copies.

Without data parallel or tensor parallel (nothing to reduce before the sum), `early` lets the
sums start during the step: the weights of a set are bucketed by the stages holding them on each
rank (DualPipe's two mirrored chunks: one bucket each), and a bucket's all-reduce is issued as soon
as this rank has run the last weight gradient of its stages (schedules/reduce.py last_weight_grad),
so at P=2 the chunk that finishes first is summed under the other's last backward. Every rank
issues its buckets in one order, computed alike everywhere from the schedule (the bucket whose
holders finish it first goes first): a bucket ready early waits for those before it, so the
collectives of a group are issued in the same order on all of its ranks, as NCCL needs. Not where
a GPU's streams share one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1: train/pipeline.py), where an
all-reduce waiting for its peer would hold back the point-to-point kernels queued behind it.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Callable, Iterator, Optional

import sys

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.reduce import last_weight_grad


def dtensor_type() -> Optional[type]:
    """torch's DTensor class if torch.distributed.tensor is loaded (FSDP2 loads it), else None:
    importing it costs ~0.5 s per rank, which a run without FSDP2 need not pay. The one copy of this
    check (parallel/split_weights.py reads it here: runtime/ stands below parallel/)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP2 DTensor's local shard, a plain tensor itself.
    Tied or mirrored copies are sharded alike (same shape, same mesh), so their local shards
    correspond element by element."""
    dtensor = dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _copies(stages: dict[int, nn.Module]) -> Iterator[tuple[int, str, nn.Parameter]]:
    """(stage, canonical name, Parameter) of every parameter of every local stage, stages in order."""
    for s in sorted(stages):
        tied = stages[s].tied
        for name, p in stages[s].named_parameters(remove_duplicate=False):
            yield s, tied.get(name, name), p


def canonical_params(stages: dict[int, nn.Module]) -> dict[str, list[nn.Parameter]]:
    """Canonical name -> this rank's distinct Parameters for it."""
    out: dict[str, list[nn.Parameter]] = defaultdict(list)
    for _, key, p in _copies(stages):
        if all(p is not q for q in out[key]):
            out[key].append(p)
    return dict(out)


def local_stages(stages: dict[int, nn.Module]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> the local stages holding a copy of it."""
    out: dict[str, set[int]] = defaultdict(set)
    for s, key, _ in _copies(stages):
        out[key].add(s)
    return {n: tuple(sorted(v)) for n, v in out.items()}


class GradSync:
    """Built once per job (collectively: every rank calls the constructor)."""

    def __init__(self, stages: dict[int, nn.Module], *, group: Optional[dist.ProcessGroup] = None,
                 pipelines: Optional[list[list[int]]] = None) -> None:
        self.local = canonical_params(stages)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        # every rank's {canonical name: its local stages holding a copy}
        here = local_stages(stages)
        self.stages_per_rank: list[dict[str, tuple[int, ...]]] = [here]
        if world > 1:
            self.stages_per_rank = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(self.stages_per_rank, here, group=group)
        names_per_rank = [sorted(held) for held in self.stages_per_rank]
        holders: dict[str, tuple[int, ...]] = defaultdict(tuple)
        for r, names in enumerate(names_per_rank):
            for n in names:
                holders[n] = holders[n] + (r,)
        me = dist.get_rank(group) if world > 1 else 0
        self.rank = me
        self.holders = dict(holders)
        # Every rank creates every subgroup, in the same order (new_group is collective).
        self.sets: list[tuple[tuple[int, ...], Optional[dist.ProcessGroup], list[str]]] = []
        by_set: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for n in sorted(holders):
            if len(holders[n]) > 1:
                by_set[holders[n]].append(n)
        pipelines = pipelines or [list(range(world))]
        for ranks in sorted(by_set):
            mine = None
            for pipeline in pipelines:  # pipeline ranks -> global ranks, one subgroup per pipeline
                pg = dist.new_group([pipeline[r] for r in ranks]) if world > 1 else None
                if dist.is_initialized() and dist.get_rank() in pipeline:
                    mine = pg
            if me in ranks:
                self.sets.append((ranks, mine, by_set[ranks]))
        self.local_only = [n for n, ps in self.local.items() if len(ps) > 1 and len(holders[n]) == 1]
        # the buckets in issue order (group, names, the boundary after which this rank may start it:
        # one per set, at the step's end, unless early() made them), the next to start, the furthest
        # boundary reached, the started ones in flight
        self._order: list[tuple[Optional[dist.ProcessGroup], list[str], float]] = [
            (pg, names, float("inf")) for _, pg, names in self.sets]
        self._next, self._reached = 0, -1.0
        self._flight: list[tuple[list[str], torch.Tensor, object]] = []
        self.started_at: list[tuple[int, int]] = []  # this step's (bucket, boundary): the sums issued early
        self.last_started_at: list[tuple[int, int]] = []  # the last synced step's

    def groups(self) -> list[dist.ProcessGroup]:
        """The subgroups this rank sums tied or mirrored weights over."""
        return [pg for _, pg, _ in self.sets if pg is not None]

    def owned(self, only: Optional[set[str]] = None) -> list[nn.Parameter]:
        """One Parameter per canonical name, on the lowest rank that holds it: summing a norm
        over every rank's `owned()` counts each tied or mirrored weight once (`only`: of these names)."""
        return [ps[0] for n, ps in sorted(self.local.items())
                if min(self.holders[n]) == self.rank and (only is None or n in only)]

    @property
    def synced_names(self) -> list[str]:
        return sorted({n for _, _, names in self.sets for n in names} | set(self.local_only))

    def early(self, schedule: Schedule, rank: int) -> dict[int, Callable[[], None]]:
        """Boundary (schedules/reduce.py: atomic actions done) -> what the executor calls there, so that
        each bucket's sum starts once this rank's last weight gradient of its stages ran (module
        docstring). Only for plain tensors summed as they are (no data or tensor parallel reduce
        before: the caller says); {} for FSDP2's sharded gradients. `rank` is the pipeline rank."""
        if rank != self.rank or any(dtensor_type() is not None and isinstance(p, dtensor_type())
                                    for ps in self.local.values() for p in ps):
            return {}
        ends = {r: last_weight_grad(schedule, r) for r in range(schedule.num_ranks)}
        count = {r: sum(1 for _ in schedule.actions(r)) for r in range(schedule.num_ranks)}

        def done(r: int, held: tuple[int, ...]) -> int:  # the boundary after rank r's last W of `held`
            return max(ends[r].get(s, count[r]) for s in held)

        buckets = []
        for ranks, pg, names in self.sets:
            by_key: dict[tuple[tuple[int, ...], ...], list[str]] = defaultdict(list)
            for n in names:
                by_key[tuple(self.stages_per_rank[r].get(n, ()) for r in ranks)].append(n)
            for key, group in by_key.items():
                when = max(done(r, held) / max(count[r], 1) for r, held in zip(ranks, key))
                buckets.append(((when, ranks, group[0]), pg, group, done(self.rank, key[ranks.index(self.rank)])))
        self._order = [(pg, group, float(mine)) for _, pg, group, mine in sorted(buckets, key=lambda b: b[0])]
        return {int(b): partial(self._reach, b) for b in {mine for _, _, mine in self._order}}

    def _reach(self, boundary: float) -> None:
        """The executor passed `boundary` (inf: the step's end): start every bucket whose turn came and
        whose stages are done, in order."""
        self._reached = max(self._reached, boundary)
        while self._next < len(self._order) and self._order[self._next][2] <= self._reached:
            pg, names, _ = self._order[self._next]
            flat = torch.cat([self._local_sum(n).reshape(-1) for n in names])
            self._flight.append((names, flat, dist.all_reduce(flat, group=pg, async_op=True)))
            if boundary != float("inf"):
                self.started_at.append((self._next, int(boundary)))
            self._next += 1

    def sync(self) -> None:
        """Sum gradients over all copies; every copy gets the sum."""
        for n in self.local_only:
            self._write(n, self._local_sum(n))
        self._reach(float("inf"))  # the buckets not started during the step
        for names, flat, work in self._flight:
            work.wait()  # type: ignore[attr-defined]
            self._write_flat(names, flat)
        self._flight, self._next, self._reached = [], 0, -1.0
        self.last_started_at, self.started_at = self.started_at, []

    def _write_flat(self, names: list[str], flat: torch.Tensor) -> None:
        """Every copy of each of `names` gets its part of the reduced buffer `flat` (in `names` order)."""
        offset = 0
        for n in names:
            shape = local_tensor(self.local[n][0]).shape
            numel = shape.numel()
            self._write(n, flat[offset: offset + numel].view(shape))
            offset += numel

    def _local_sum(self, name: str) -> torch.Tensor:
        ps = self.local[name]
        if len(ps) == 1 and ps[0].grad is not None:  # one copy here: its gradient is the sum (no new tensor)
            return local_tensor(ps[0].grad)
        total = torch.zeros_like(local_tensor(ps[0]))
        for p in ps:
            if p.grad is not None:
                total += local_tensor(p.grad)
        return total

    def _write(self, name: str, value: torch.Tensor) -> None:
        ps = self.local[name]
        if len(ps) == 1 and type(ps[0].grad) is torch.Tensor and value.shape == ps[0].grad.shape:
            ps[0].grad = value  # one plain copy: it takes the sum itself (a view of the reduced buffer), no copy back
            return
        for p in ps:
            if p.grad is None:
                dtensor = dtensor_type()
                p.grad = (dtensor.from_local(value.clone(), p.device_mesh, p.placements, run_check=False)
                          if dtensor is not None and isinstance(p, dtensor) else value.clone())
            else:
                local_tensor(p.grad).copy_(value)
