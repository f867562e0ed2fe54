"""Data-parallel gradient reduction of one rank's stages: issued by the executor at each
`{stage}REDUCE_GRAD` (right after the stage's last weight gradient), waited for at the end
of the step, so the reductions overlap the pipeline's drain.

`GradReducer` is what the executor calls; `BucketAllReduce` is the dp_replicate one: the
stage's gradients flattened into buckets of at most `bucket_mb` (DDP's 25 MB by default),
one asynchronous all-reduce per bucket over the data-parallel group, summed in
`reduce_dtype` (fp32 by default) and divided by the group size on the way back (gloo has no
AVG). Gradients were accumulated over the step's microbatches in fp32 before (parameters are
fp32), so there is one reduction per stage per step whatever the microbatch count: no
`no_sync` context to forget, which is what breaks DDP under 1F1B (pytorch/PiPPy#1133).
FSDP2 stages reduce-scatter instead (parallel/fsdp.py provides that reducer).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn


class GradReducer(Protocol):
    counts: Counter  # stage -> reductions issued since the counter was reset (tests read it)

    def begin(self) -> None:
        """Start of a step, before its first forward."""
        ...

    def gather(self) -> None:
        """Node-level execution (runtime/nodes.py) is about to run the step's forwards: make every stage's
        parameters whole now (a sharding reducer's forward hooks, which would, are bypassed by nodes)."""
        ...

    def reduce(self, stage: int) -> None:
        """Start reducing `stage`'s gradients (asynchronous); called once per stage per step."""
        ...

    def poll(self) -> list[int]:
        """Stages whose reductions completed since the last call, without waiting (a reducer that
        cannot tell returns [] and reports them in `finish`)."""
        ...

    def finish(self, done: Callable[[int], None] = lambda stage: None) -> None:
        """Wait for every reduction of the step and leave the reduced gradients in `.grad`;
        `done(stage)` as each stage's is complete (in the order they were issued)."""
        ...


def buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters in groups of at most `bucket_bytes` (a larger tensor alone)."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class BucketAllReduce:
    """All-reduce (mean) of each stage's gradients over the data-parallel group, bucketed."""

    def __init__(self, stages: Mapping[int, nn.Module], *, group: Optional[dist.ProcessGroup], size: int,
                 reduce_dtype: torch.dtype = torch.float32, bucket_mb: float = 25.0) -> None:
        self.group, self.size, self.reduce_dtype = group, size, reduce_dtype
        self._buckets = {
            s: buckets([p for p in mod.parameters() if p.requires_grad], int(bucket_mb * 2**20))
            for s, mod in stages.items()
        }
        self._pending: list[tuple[int, dist.Work, torch.Tensor, list[nn.Parameter]]] = []  # (stage, ...)
        self._polled: set[int] = set()  # stages poll() already reported done this step
        self.counts: Counter = Counter()

    def begin(self) -> None:
        pass

    def gather(self) -> None:
        pass  # replicated parameters are whole

    def reduce(self, stage: int) -> None:
        self.counts[stage] += 1
        for bucket in self._buckets[stage]:
            flat = torch.cat([_grad(p).reshape(-1) for p in bucket]).to(self.reduce_dtype)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((stage, work, flat, bucket))

    def poll(self) -> list[int]:
        busy = {s for s, work, _, _ in self._pending if not work.is_completed()}
        new = [s for s in dict.fromkeys(s for s, *_ in self._pending) if s not in busy and s not in self._polled]
        self._polled.update(new)
        return new

    def finish(self, done: Callable[[int], None] = lambda stage: None) -> None:
        pending, self._pending = self._pending, []
        for i, (stage, work, flat, bucket) in enumerate(pending):
            work.wait()
            if i + 1 == len(pending) or pending[i + 1][0] != stage:  # the stage's last bucket
                done(stage)
            flat = flat.float().div_(self.size) if flat.dtype != torch.float32 else flat.div_(self.size)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset: offset + n].view_as(p).to(p.dtype)
                offset += n
        self._polled.clear()


def _grad(p: nn.Parameter) -> torch.Tensor:
    """A parameter's gradient; zeros when this rank's microbatches never reached it (its peers' may)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)
