"""All expert-parallel communication: tokens to the ranks holding their experts and back.

The one module for EP traffic, as comm.py is for point-to-point. An EP group of `ep` ranks splits
a layer's E experts into ep consecutive blocks of E/ep; every rank routes its own tokens, then

  dispatch   counts exchange (all_to_all_single of the (E,) assignments per expert, E/ep to each
             rank), then the tokens, sorted by expert, to the rank holding their expert (uneven
             all_to_all_single: splits from the counts), then rank-major -> expert-major, so the
             local experts see their rows contiguous: by local expert, then source rank, then the
             source's own (token) order. Deterministic: the same bits on every run.
  combine    the inverse permutation and the reverse all-to-all (splits swapped).

Both all-to-alls are autograd functions whose backward is the reverse all-to-all, so the input
gradient (B) carries them back; the counts need no gradient. Every rank of an EP group runs the
same schedule on the same stage, so their all-to-alls come in the same order (what NCCL needs:
one communicator's collectives run in issue order). gloo implements the uneven all-to-all on the CPU.
In a measured step each all-to-all here (the counts exchange too) reaches the step's record inside
the action that ran it (runtime/collectives.py): the Chrome trace and moe/a2a_ms.

Node-level execution (runtime/nodes.py) drives the pieces itself: `exchange` (counts, blocking),
`start` -> `Started.wait()` (the all-to-all without autograd, async_op=True: gloo runs it on its
worker threads while this thread computes), `expert_major` / `source_major` (the permutations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from pipetrain.runtime import collectives


@dataclass(frozen=True)
class EPGroup:
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int  # this rank's ep index: it holds experts [rank E/ep, (rank + 1) E/ep)
    # An emulated network latency per token all-to-all (bench/moe_fb_overlap.py's deterministic
    # variant): its output is ready no sooner than delay_s after its start. A sleep in `wait`, so it
    # costs no CPU: a blocking all-to-all pays it whole, an overlapped one hides it under compute.
    delay_s: float = 0.0


class _AllToAll(torch.autograd.Function):
    """Rows `in_splits[r]` of x to rank r, `out_splits[r]` rows from rank r; backward the reverse."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, g, what):  # type: ignore[override]
        ctx.splits, ctx.g, ctx.what = (out_splits, in_splits), g, what
        return _all_to_all(x, out_splits, in_splits, g, f"a2a:{what}")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.g, f"a2a:{ctx.what} B"), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup, label: str) -> torch.Tensor:
    """Blocking (whole-stage execution): the time from its start to its end is all exposed; a measured
    step's record gets it (runtime/collectives.py)."""
    tap = collectives.sink()
    t0 = tap.mark() if tap is not None else 0
    out = start(x, out_splits, in_splits, g).wait()
    if tap is not None:
        tap.collective("ep", label, out.nbytes, t0, t0)  # bytes: its output, this rank's own rows included
    return out


class Started:
    """An all-to-all in flight (gloo runs it on the group's worker threads): `wait()` -> its output."""

    __slots__ = ("out", "work", "span", "ready_at")

    def __init__(self, out: torch.Tensor, work: Optional[dist.Work], ready_at: float = 0.0) -> None:
        self.out, self.work = out, work
        self.ready_at = ready_at  # perf_counter time before which wait() does not return (EPGroup.delay_s)
        self.span: Optional[list] = None  # the caller's timing record (runtime/nodes.py A2ALog)

    def wait(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """The output once arrived; past `timeout_s` (None: the group's timeout) the backend raises."""
        if self.work is not None:
            if timeout_s is None:
                self.work.wait()
            else:
                self.work.wait(timedelta(seconds=timeout_s))
            self.work = None
        if self.ready_at:
            time.sleep(max(0.0, self.ready_at - time.perf_counter()))
            self.ready_at = 0.0
        return self.out


def start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup) -> Started:
    """Start sending rows `in_splits[r]` of x to rank r, receiving `out_splits[r]` rows from each; no
    autograd (node-level execution issues the reverse itself, runtime/nodes.py)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=g.group, async_op=True)
    return Started(out, work, time.perf_counter() + g.delay_s if g.delay_s else 0.0)


class Routed(NamedTuple):
    """What combine needs of a dispatch: the expert-major order of the received rows and the splits."""

    order: torch.Tensor  # (M,) received row of each expert-major row
    send: list[int]  # rows this rank sent to each rank
    recv: list[int]  # rows it received from each rank


def exchange(counts: torch.Tensor, g: EPGroup, device: torch.device) -> tuple[torch.Tensor, Routed]:
    """The counts exchange of a dispatch (blocking: the splits are host values): counts (E,) per global
    expert of this rank's rows -> (counts per local expert (E/ep,) of the rows it receives, the splits
    and expert-major order dispatch and combine use; a backward reuses them: no exchange there)."""
    local = counts.numel() // g.size
    mine = torch.empty_like(counts)  # from rank r: its counts for my experts, E/ep of them
    tap = collectives.sink()
    t0 = tap.mark() if tap is not None else 0
    dist.all_to_all_single(mine, counts.contiguous(), group=g.group)
    if tap is not None:
        tap.collective("ep", "a2a:counts", mine.nbytes, t0, t0)
    mine = mine.view(g.size, local)  # (ep sources, E/ep local experts)
    send = counts.view(g.size, local).sum(1).tolist()  # host values: the splits (one sync, as torchtitan)
    recv = mine.sum(1).tolist()
    # expert-major: local expert j's rows from source 0, then source 1, ..., each in its source's order
    key = torch.arange(local, device=mine.device).repeat(g.size) * g.size + \
        torch.arange(g.size, device=mine.device).repeat_interleave(local)  # (source, expert) -> j ep + s
    order = torch.argsort(torch.repeat_interleave(key, mine.reshape(-1)), stable=True).to(device)
    return mine.sum(0), Routed(order, send, recv)


def expert_major(rows: torch.Tensor, routed: Routed) -> torch.Tensor:
    """Received rows (M, H) by source rank -> by local expert (what the local experts read)."""
    return rows.index_select(0, routed.order)


def source_major(y: torch.Tensor, routed: Routed) -> torch.Tensor:
    """The inverse of expert_major: the experts' rows back in received order, to be sent home."""
    back = torch.empty_like(routed.order)
    back[routed.order] = torch.arange(routed.order.numel(), device=routed.order.device)
    return y.index_select(0, back)


def dispatch(x: torch.Tensor, counts: torch.Tensor, g: EPGroup) -> tuple[torch.Tensor, torch.Tensor, Routed]:
    """x (N, H) sorted by global expert id, counts (E,) per expert -> (this rank's rows (M, H) in
    local-expert-major order, their counts per local expert (E/ep,), what combine needs)."""
    local_counts, routed = exchange(counts, g, x.device)
    rows = _AllToAll.apply(x, routed.recv, routed.send, g, "dispatch")  # (M, H): by source rank, then by local expert
    return expert_major(rows, routed), local_counts, routed


def combine(y: torch.Tensor, routed: Routed, g: EPGroup) -> torch.Tensor:
    """The experts' rows (M, H) in dispatch's local order -> (N, H) back in x's order on its rank."""
    return _AllToAll.apply(source_major(y, routed), routed.send, routed.recv, g, "combine")
