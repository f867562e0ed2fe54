"""All point-to-point communication of the pipeline: it carries out a rank's `RankTransfers`.

The plan (schedules/p2p.py, pure) says which messages cross ranks and at which boundary
between two actions each is issued, grouped per peer, in an order both ranks of a pair
share. This transport only executes it:

  - `produced(msg, t)`  the executor hands over a tensor to send once the plan says so;
  - `issue(i)`          posts the groups of boundary i (a receive gets its buffer here);
  - `receive(msg)`      waits for a posted receive and returns its buffer;
  - `finish()`          waits for every send of the step.

Transports (`pipeline.p2p_transport`): `pair_groups` posts each group on the 2-rank process
group of its pair (parallel/mesh.py: build_pair_groups), so on NCCL every pair has its own communicator and
stream; `one_group` posts everything on the pipeline's process group, whose one NCCL stream
runs a rank's groups to all peers in issue order (a send may queue behind a receive from the
other neighbour; the validator refuses plans that deadlock so).

Backends:
  - NCCL: each group is one `batch_isend_irecv` (one step of the pair's order).
  - gloo: plain send/recv with a tag per message (`batch_isend_irecv` has been reported
    to hang with gloo, pytorch/PiPPy#989, pytorch/pytorch#132644), posted on the process
    group itself (`ProcessGroup.send/recv`, what `dist.isend/irecv` call after checking their
    arguments: group, peer rank in it and tag are worked out once per plan, `_Prepared`).
  - gloo, in order (`pipeline.p2p_in_order`, for tests): gloo made to behave like NCCL under
    the transport. Every message of a pair carries the same tag, so messages match by
    position, and a rank's groups run one after another on a thread per NCCL stream (one per
    peer with pair_groups, one for all peers with one_group), like kernels on that stream: a
    group is posted once the previous one has completed. A plan that would deadlock or mix up
    messages on NCCL does so here too, on CPU.

Waits: on gloo every wait has a timeout, and a timeout or a dead peer raises `P2PError` naming
this rank, the action and the peer, as global ranks (with their pp / dp / tp coordinates when the
layout has more than the pipeline: `name_ranks`). On NCCL a wait is a stream wait (`host_timed_wait`): the host
runs ahead, and the pair group's timeout (NCCL's watchdog) ends a hang. On NCCL completed sends are
dropped at every boundary; gloo only reports completion through `wait`, so there sends are waited
for at the end of the step. A gloo work is waited for once only (a second wait on a receive blocks
for a message that never comes).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import defaultdict
from typing import Callable, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from pipetrain.compat import set_group_timeout
from pipetrain.schedules.p2p import Group, Message, RankTransfers


class RankNames(Protocol):
    """What names a global rank in messages: parallel/layout.py's Layout, read through this alone, so
    runtime/ (which parallel/ builds on) imports nothing of parallel/."""

    def rank_name(self, rank: int) -> str: ...


class P2PError(RuntimeError):
    """A point-to-point wait failed: timed out, or the peer is gone."""


class _Prepared(NamedTuple):
    """One group of a plan as this transport posts it, worked out once per plan."""

    group: Group
    process_group: Optional[dist.ProcessGroup]  # None: the default one (one_group without a group)
    peer: int  # the peer's global rank (batch_isend_irecv's P2POp takes that)
    posted_on: Optional[dist.ProcessGroup]  # gloo: the process group it is posted on, and
    peer_in_group: int  # the peer's rank in it
    send_tags: tuple[int, ...]
    recvs: tuple[tuple[Message, int, int], ...]  # (message, tag, consumer stage)


class _Posted:
    """One group toward one peer, as posted (or queued, in order mode)."""

    __slots__ = ("group", "prepared", "send_works", "recv_works", "recv_bufs", "send_bufs", "done", "error")

    def __init__(self, prepared: _Prepared, in_order: bool) -> None:
        self.group, self.prepared = prepared.group, prepared
        self.send_works: list[dist.Work] = []
        self.recv_works: dict[Message, list[dist.Work]] = {}  # what a receive waits for
        self.recv_bufs: dict[Message, torch.Tensor] = {}
        self.send_bufs: list[torch.Tensor] = []
        # in order mode only: the group has completed (an Event is a lock and a condition: not per group elsewhere)
        self.done: Optional[threading.Event] = threading.Event() if in_order else None
        self.error: Optional[BaseException] = None


def host_timed_wait(backend: str) -> bool:
    """Whether a P2P wait blocks the host with a timeout: on gloo, yes (the only way to bound it).
    On NCCL no: `Work.wait(timeout)` blocks the CPU thread until the kernels complete (torch >= 2.6,
    pytorch/pytorch#137295), draining the GPU queue at every receive, while `wait()` only makes the
    current stream wait, which is all a receive buffer needs; the pair group's timeout ends a hang."""
    return backend != "nccl"


class _Stream:
    """In order mode: one NCCL stream of this rank (toward one peer, or toward all peers with
    one_group), run by a thread like a CUDA stream.

    Groups run one after another: the next is posted only once every operation of the
    previous one has completed. (gloo only reports completion through `wait`, hence a
    thread per stream rather than polling.)
    """

    def __init__(self, comm: "P2P", peer: Optional[int]) -> None:
        self.comm = comm
        self.queue: "queue.SimpleQueue[Optional[_Posted]]" = queue.SimpleQueue()
        name = f"p2p-stream-{'all' if peer is None else peer}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        failed: Optional[BaseException] = None  # a broken stream fails every later group with its first error
        while (posted := self.queue.get()) is not None:
            try:
                if failed is None:
                    peer = posted.group.peer

                    def what(peer: Optional[int] = peer) -> str:  # this group's peer, bound now (formatted on failure)
                        return f"its in-order stream's group with {self.comm.name(peer)}"

                    self.comm._post(posted)
                    for work in posted.send_works + [w for ws in posted.recv_works.values() for w in ws]:
                        self.comm._wait(work, what, peer)
            except BaseException as e:  # handed to the main thread, which raises it where it waits
                failed = e
            posted.error = failed
            assert posted.done is not None
            posted.done.set()


class P2P:
    """Point-to-point transport for one rank over a torch.distributed process group.

    `pair_groups` (pipeline.p2p_transport=pair_groups): peer global rank -> the pair's process
    group (parallel/mesh.py: build_pair_groups); None posts everything on `group` (one_group). `in_order` streams
    follow the transport: one per peer with pair groups, one per rank without."""

    def __init__(
        self,
        rank: int,
        *,
        num_microbatches: int,
        timeout_s: float,
        group: Optional[dist.ProcessGroup] = None,
        group_ranks: Optional[list[int]] = None,
        in_order: bool = False,
        pair_groups: Optional[dict[int, dist.ProcessGroup]] = None,
        consumer_stage: Callable[[Message], int] = lambda m: m.stage,
    ) -> None:
        self.rank = rank
        self.num_microbatches = num_microbatches
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group
        self._global = group_ranks  # pipeline rank -> global rank (None: the same)
        self._layout: Optional[RankNames] = None  # name_ranks: coordinates in the messages
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self.nccl = backend == "nccl"
        self.timed_waits = host_timed_wait(backend)
        self.in_order = in_order and not self.nccl  # NCCL is in order by itself
        self.pair_groups = pair_groups
        # In order mode emulates the transport's NCCL streams: one per pair of ranks with pair
        # groups, one per rank on a single process group.
        self.stream_per_peer = pair_groups is not None
        self.consumer_stage = consumer_stage
        self.plan: Optional[RankTransfers] = None
        # id(plan) -> (plan, its groups per boundary as posted): worked out at a plan's first step
        self._prepared: dict[int, tuple[RankTransfers, list[list[_Prepared]]]] = {}
        # in order mode: peer (or None: all) -> stream, kept across steps
        self._streams: dict[Optional[int], _Stream] = {}

    # ---- one step -----------------------------------------------------------------
    def begin(self, plan: RankTransfers, buffer_for: Callable[[Message], torch.Tensor]) -> None:
        self.plan, self.buffer_for = plan, buffer_for
        self._groups = self._prepare(plan)
        self._ready: dict[Message, torch.Tensor] = {}  # produced, not yet issued
        self._recvs: dict[Message, tuple[_Posted, int, int]] = {}  # issued, not yet taken -> (group, stage, bytes)
        self._inflight: list[_Posted] = []  # posted groups whose sends are not yet waited for
        self._pending_bytes: dict[int, int] = defaultdict(int)
        self.peak_recv_bytes: dict[int, int] = defaultdict(int)  # consumer stage -> peak bytes of live buffers

    def produced(self, msg: Message, tensor: torch.Tensor) -> None:
        self._ready[msg] = tensor.detach().contiguous()

    def issue(self, boundary: int) -> None:
        """Post the groups the plan puts at this boundary (before part `boundary`)."""
        pending, peak = self._pending_bytes, self.peak_recv_bytes
        for prepared in self._groups[boundary]:
            g = prepared.group
            posted = _Posted(prepared, self.in_order)
            posted.send_bufs = [self._ready.pop(m) for m in g.sends]
            for m, _, stage in prepared.recvs:
                buf = posted.recv_bufs[m] = self.buffer_for(m)
                nbytes = buf.untyped_storage().nbytes()
                self._recvs[m] = (posted, stage, nbytes)
                pending[stage] += nbytes
                if pending[stage] > peak[stage]:
                    peak[stage] = pending[stage]
            if self.in_order:
                key = g.peer if self.stream_per_peer else None
                if key not in self._streams:
                    self._streams[key] = _Stream(self, key)
                self._streams[key].queue.put(posted)
            else:
                self._post(posted)
            self._inflight.append(posted)
        if self.nccl:  # drop completed groups, freeing their send tensors (gloo reports completion only via wait)
            self._inflight = [p for p in self._inflight
                              if p.recv_bufs or not all(w.is_completed() for w in p.send_works)]

    def receive(self, msg: Message, *, action: str) -> torch.Tensor:
        posted, stage, nbytes = self._recvs.pop(msg)

        def what() -> str:  # formatted only when a wait fails: receives are per action
            return f"{action} waiting for the {msg.describe()} from {self.name(msg.src)}"

        if self.in_order:
            self._wait_group(posted, what, msg.src)
        else:
            for work in posted.recv_works[msg]:
                self._wait(work, what, msg.src)
        self._pending_bytes[stage] -= nbytes
        return posted.recv_bufs.pop(msg)

    def finish(self) -> None:
        """Wait for every operation of the step; fail if something was left unissued or untaken."""
        assert self.plan is not None
        if self._ready or self._recvs:
            left = ", ".join(m.describe() for m in list(self._ready) + list(self._recvs))
            raise P2PError(f"{self.name(self.rank)}: messages never issued or consumed this step: {left}")
        for posted in self._inflight:
            peer = posted.group.peer

            def what(posted: _Posted = posted, peer: int = peer) -> str:
                return (f"end of step waiting for {self.name(peer)} to take the "
                        f"{', '.join(m.describe() for m in posted.group.sends)}")

            if self.in_order:
                self._wait_group(posted, what, peer)
            else:  # a gloo work must be waited for once only: receives were, in receive()
                for w in posted.send_works:
                    self._wait(w, what, peer)
        self._inflight.clear()
        self.plan = None

    def set_timeout(self, timeout_s: float) -> None:
        """The timeout of every later wait. A compiled run's first step sets a longer one
        (trainer.compile_timeout_s): a peer compiling its layers is slow, not stuck."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        if self.nccl:  # NCCL's waits are stream waits: the groups' own timeout is what ends a hang
            for group in (self.pair_groups or {None: self.group}).values():
                set_group_timeout(group if group is not None else dist.group.WORLD, timeout_s)

    def close(self) -> None:
        """Stop the in-order streams' threads: each ends after the groups queued before it. After
        a step that completed they are idle and end at once; after a failed one a stream may still
        sit in a wait that only its timeout ends, so it is not waited for (the threads are daemons)."""
        for stream in self._streams.values():
            stream.queue.put(None)
        for stream in self._streams.values():
            stream.thread.join(timeout=1.0)
        self._streams.clear()

    # ---- naming ranks ---------------------------------------------------------------
    def name_ranks(self, layout: RankNames) -> None:
        """Messages give global ranks their coordinates: a pipeline index alone ("rank 0") names
        dp x tp ranks at once, and the user kills, reads the log of, and restarts global ranks.
        `layout` is the run's Layout (parallel/layout.py), read through its rank_name only."""
        self._layout = layout

    def short(self, pipeline_rank: int) -> str:
        """'rank G': the global rank of this pipeline's rank `pipeline_rank`."""
        return f"rank {self._peer(pipeline_rank)}"

    def name(self, pipeline_rank: int) -> str:
        """'rank G', or as name_ranks' layout names it: 'rank G (pp p, dp_replicate r)'."""
        g = self._peer(pipeline_rank)
        return f"rank {g}" if self._layout is None else self._layout.rank_name(g)

    # ---- posting and waiting ------------------------------------------------------
    def _peer(self, pipeline_rank: int) -> int:
        return pipeline_rank if self._global is None else self._global[pipeline_rank]

    def _prepare(self, plan: RankTransfers) -> list[list[_Prepared]]:
        """Per boundary, its groups as posted: computed at a plan's first step, kept for the next."""
        if id(plan) in self._prepared and self._prepared[id(plan)][0] is plan:
            return self._prepared[id(plan)][1]
        M, in_order = self.num_microbatches, self.in_order
        out = []
        for groups in plan.issue:
            out.append([])
            for g in groups:
                peer = self._peer(g.peer)
                group = self.group if self.pair_groups is None else self.pair_groups[peer]
                posted_on = None if self.nccl else (group if group is not None else dist.group.WORLD)
                # In order, every message of a pair has one tag: gloo then matches them by position, as NCCL does.
                tags = [0 if in_order else m.tag(M) for m in g.sends + g.recvs]
                out[-1].append(_Prepared(
                    g, group, peer, posted_on, dist.get_group_rank(posted_on, peer) if posted_on is not None else -1,
                    tuple(tags[:len(g.sends)]),
                    tuple((m, tag, self.consumer_stage(m)) for m, tag in zip(g.recvs, tags[len(g.sends):]))))
        if len(self._prepared) >= 4:  # the executor's two plans; a caller passing new ones each step
            self._prepared.pop(next(iter(self._prepared)))
        self._prepared[id(plan)] = (plan, out)
        return out

    def _post(self, posted: _Posted) -> None:
        p = posted.prepared
        if self.nccl:  # on a pair group: that pair's own communicator and stream
            ops = [dist.P2POp(dist.isend, t, p.peer, p.process_group) for t in posted.send_bufs]
            ops += [dist.P2POp(dist.irecv, b, p.peer, p.process_group) for b in posted.recv_bufs.values()]
            posted.send_works = dist.batch_isend_irecv(ops)
            # One NCCL group completes as a whole: a receive waits for the group's works.
            posted.recv_works = {m: posted.send_works for m in posted.recv_bufs}
            return
        pg, peer = p.posted_on, p.peer_in_group
        assert pg is not None
        posted.send_works = [pg.send([t], peer, tag) for t, tag in zip(posted.send_bufs, p.send_tags)]
        posted.recv_works = {m: [pg.recv([posted.recv_bufs[m]], peer, tag)] for m, tag, _ in p.recvs}

    def _wait_group(self, posted: _Posted, what: Callable[[], str], peer: int) -> None:
        """In order mode: wait until the peer's stream has run this group."""
        assert posted.done is not None
        if not posted.done.wait(timeout=self.timeout.total_seconds() + 1.0):
            raise P2PError(
                f"{self.name(self.rank)}: {what()} timed out after {self.timeout.total_seconds():g}s (in-order "
                f"point-to-point): {self.short(peer)} is stuck or dead, or the two ranks issue their messages in "
                f"different orders (raise pipeline.p2p_timeout_s if it is only slow)")
        if posted.error is not None:
            raise P2PError(f"{self.name(self.rank)}: {what()}: {posted.error}; in-order point-to-point also times out "
                           f"when two ranks issue their messages in different orders") from None

    def _wait(self, work: dist.Work, what: Callable[[], str], peer: int) -> None:
        """Wait for one work; `what` describes the wait, formatted only if it fails."""
        try:
            ok = work.wait(timeout=self.timeout) if self.timed_waits else work.wait()
        except RuntimeError as e:
            text = str(e)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise P2PError(
                    f"{self.name(self.rank)}: {what()} timed out after {self.timeout.total_seconds():g}s: "
                    f"{self.short(peer)} is stuck or dead (raise pipeline.p2p_timeout_s if it is only slow)"
                ) from None
            raise P2PError(
                f"{self.name(self.rank)}: {what()} failed: the connection to {self.short(peer)} was lost, so that "
                f"rank (or one it depends on) died; pipeline.p2p_timeout_s bounds every wait"
            ) from None
        if ok is False:
            raise P2PError(f"{self.name(self.rank)}: {what()} did not complete ({self.short(peer)})")
