"""All expert-parallel communication: tokens to the ranks holding their experts and back.

The one module for EP traffic, as comm.py is for point-to-point. An EP group of `ep` ranks splits
a layer's E experts into ep consecutive blocks of E/ep; every rank routes its own tokens, then
(the phases of models/moe.py MoE.phases, the one place they are composed)

  exchange      counts exchange (all_to_all_single of the (E,) assignments per expert, E/ep to each
                rank): the splits and the expert-major order (`Routed`)
  dispatch      the tokens, sorted by expert, to the rank holding their expert (uneven
                all_to_all_single: splits from the counts)
  expert_major  rank-major -> expert-major, so the local experts see their rows contiguous: by local
                expert, then source rank, then the source's own (token) order. Deterministic: the same
                bits on every run.
  source_major  the inverse permutation, then combine: the reverse all-to-all (splits swapped).

Whole-stage execution runs each all-to-all with `all_to_all`, an autograd function whose backward is
the reverse all-to-all, so the input gradient (B) carries them back; the counts need no gradient.
Every rank of an EP group runs the same schedule on the same stage, so their all-to-alls come in the
same order (what NCCL needs: one communicator's collectives run in issue order). gloo implements the
uneven all-to-all on the CPU. In a measured step each all-to-all here (the counts exchange too)
reaches the step's record inside the action that ran it (runtime/collectives.py): the Chrome trace
and moe/a2a_ms.

Node-level execution (runtime/nodes.py) runs the same phases, each all-to-all as `start` ->
`Started.wait()` (without autograd, async_op=True; it issues the reverse itself). Where the all-to-all
runs while this thread computes:

  CPU (gloo)   on the group's worker threads; `wait()` blocks the host until it has arrived.
  CUDA (NCCL)  on a communication stream of node mode's own (`start(..., stream=)`, design note C4.5):
               the comm stream waits for the compute stream (the rows are written there), issues the
               all-to-all and records an event; `wait()` makes the compute stream wait for that event.
               No host sync: the host queues the other microbatch's kernels at once, and the GPU runs
               them beside the transfer. Each tensor that crosses is recorded on the stream that reads
               it (`record_stream`), so the caching allocator does not hand its memory out early. A
               hang is ended by the group's own timeout (NCCL's watchdog): `Work.wait(timeout)` would
               block the host (runtime/comm.py host_timed_wait).

The counts exchange is the one host sync a dispatch makes (the splits are host values), planned and so
exempt from `torch.cuda.set_sync_debug_mode` (`planned_sync`); a backward reuses its forward's splits.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist

from pipetrain.compat import cuda_sleep, cuda_sleep_cycles_per_ms
from pipetrain.runtime import collectives


@dataclass(frozen=True)
class EPGroup:
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int  # this rank's ep index: it holds experts [rank E/ep, (rank + 1) E/ep)
    # An emulated network latency per token all-to-all (bench/moe_fb_overlap.py's deterministic
    # variant, the one-GPU check's stand-in network): its output is ready no sooner than delay_s after
    # its start. On CPU a host sleep in `wait`; on CUDA a GPU sleep (compat.cuda_sleep, one thread
    # block spinning) on the stream that issues the transfer, before it, so the collective (and the
    # next one on the group's communicator) starts that much later. Neither costs compute: a blocking
    # all-to-all pays it whole and an overlapped one hides it under the other microbatch.
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
    # bytes: its output, this rank's own rows included
    return collectives.blocking("ep", label, lambda: start(x, out_splits, in_splits, g).wait())


class Started:
    """An all-to-all in flight: `wait()` -> its output (module docstring: where it runs)."""

    __slots__ = ("out", "work", "span", "ready_at", "done")

    def __init__(self, out: torch.Tensor, work: Optional[dist.Work], delay_s: float = 0.0,
                 done: Optional[torch.cuda.Event] = None) -> None:
        self.out, self.work, self.done = out, work, done  # done: the comm stream's event (CUDA node mode)
        # the perf_counter time before which wait() does not return (CPU: EPGroup.delay_s)
        self.ready_at = time.perf_counter() + delay_s if delay_s else 0.0
        self.span: Optional[list] = None  # the caller's timing record (runtime/nodes.py A2ALog)

    def wait(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """The output once arrived (on CUDA: once the current stream has waited for it; the host goes on).
        On CPU past `timeout_s` (None: the group's timeout) the backend raises."""
        if self.work is not None:
            if timeout_s is None or self.out.is_cuda:
                self.work.wait()
            else:
                self.work.wait(timedelta(seconds=timeout_s))
            self.work = None
        if self.done is not None:
            current = torch.cuda.current_stream(self.out.device)
            current.wait_event(self.done)
            self.out.record_stream(current)  # made on the comm stream, read on this one
            self.done = None
        if self.ready_at:
            time.sleep(max(0.0, self.ready_at - time.perf_counter()))
            self.ready_at = 0.0
        return self.out


def start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup,
          stream: Optional[torch.cuda.Stream] = None) -> Started:
    """Start sending rows `in_splits[r]` of x to rank r, receiving `out_splits[r]` rows from each; no
    autograd (node-level execution issues the reverse itself, runtime/nodes.py). `stream`: on CUDA, the
    communication stream it runs on (module docstring); None: issued from the current stream."""
    x = x.contiguous()
    if stream is None:
        if x.is_cuda and g.delay_s:
            gpu_sleep(g.delay_s, x.device)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=g.group, async_op=True)
        return Started(out, work, 0.0 if x.is_cuda else g.delay_s)
    stream.wait_stream(torch.cuda.current_stream(x.device))  # x, and what it was computed from, is written
    with torch.cuda.stream(stream):
        if g.delay_s:
            gpu_sleep(g.delay_s, x.device)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))  # allocated on the comm stream
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=g.group, async_op=True)
        work.wait()  # NCCL: the comm stream waits for the collective's stream, the host does not
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)  # read on the comm stream: not reused by the compute stream before it is sent
    return Started(out, None, done=done)


@functools.lru_cache(maxsize=None)
def _gpu_cycles_per_s(index: int) -> float:
    """Clock cycles of cuda_sleep per second on GPU `index`, measured once (compat.cuda_sleep_cycles_per_ms); its
    host sync is planned."""
    with torch.cuda.device(index), planned_sync(torch.device("cuda", index)):
        return 1e3 * cuda_sleep_cycles_per_ms()


def gpu_sleep(seconds: float, device: torch.device) -> None:
    """Queue a GPU sleep of about `seconds` on the current stream of `device` (EPGroup.delay_s)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cuda_sleep(int(seconds * _gpu_cycles_per_s(index)))


@contextlib.contextmanager
def planned_sync(device: torch.device) -> Iterator[None]:
    """A host sync the dispatch cannot do without (the splits), exempt from torch.cuda.set_sync_debug_mode:
    a check that every other sync is an error (tests/test_gpu.py) runs with this one allowed."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


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
    def counts_a2a() -> torch.Tensor:
        dist.all_to_all_single(mine, counts.contiguous(), group=g.group)
        return mine

    collectives.blocking("ep", "a2a:counts", counts_a2a)
    mine = mine.view(g.size, local)  # (ep sources, E/ep local experts)
    with planned_sync(counts.device):  # host values: the splits (one sync, as torchtitan)
        splits = torch.cat([counts.view(g.size, local).sum(1), mine.sum(1)]).tolist()
    send, recv = splits[:g.size], splits[g.size:]
    # expert-major: local expert j's rows from source 0, then source 1, ..., each in its source's order
    key = torch.arange(local, device=mine.device).repeat(g.size) * g.size + \
        torch.arange(g.size, device=mine.device).repeat_interleave(local)  # (source, expert) -> j ep + s
    # output_size: the rows' count known on the host, so repeat_interleave does not read it back (a sync)
    order = torch.argsort(torch.repeat_interleave(key, mine.reshape(-1), output_size=sum(recv)), stable=True).to(device)
    return mine.sum(0), Routed(order, send, recv)


def expert_major(rows: torch.Tensor, routed: Routed) -> torch.Tensor:
    """Received rows (M, H) by source rank -> by local expert (what the local experts read)."""
    return rows.index_select(0, routed.order)


def source_major(y: torch.Tensor, routed: Routed) -> torch.Tensor:
    """The inverse of expert_major: the experts' rows back in received order, to be sent home."""
    back = torch.empty_like(routed.order)
    back[routed.order] = torch.arange(routed.order.numel(), device=routed.order.device)
    return y.index_select(0, back)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: EPGroup, what: str) -> torch.Tensor:
    """Whole-stage execution's all-to-all (models/moe.py run_whole): rows `in_splits[r]` of x (N, H) to
    rank r, `out_splits[r]` rows from each; blocking, its backward the reverse. `what`: its node's name
    (schedules/fb_pairs.py DISPATCH | COMBINE), the label "a2a:{what}" ("a2a:{what} B" backward)."""
    return _AllToAll.apply(x, out_splits, in_splits, g, what)
