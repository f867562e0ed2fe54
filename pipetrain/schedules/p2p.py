"""The point-to-point plan of a schedule: which messages cross ranks, and when each is issued.

Which tensors cross ranks is a pure function of the placement and the actions:

  F(s, m)      sends its output (ACT, s, m) to the rank of next(s), if that is another rank
  B/BW(s, m)   sends its input grad (GRAD, s, m) to the rank of prev(s), likewise

NCCL runs the operations between one pair of ranks in order, on one stream, and matches
the k-th send of a to b with the k-th receive of b from a; with the default transport
(`pipeline.p2p_transport=pair_groups`: a 2-rank process group per pair) each pair has its own
stream, with `one_group` a rank's operations toward all peers share one. So a plan is safe only if
(1) per direction, the sender sends in the order the receiver receives, (2) per pair, both
ranks issue their messages in one order (operations posted together in one group, as
`batch_isend_irecv` does, count as one step of it), and (3) no operation waits on one
issued after it on its stream. `p2p_check.check_plan` (pure, no torch) checks (1) and (2) for
every plan, and (3) by running every rank's plan under the transport's stream rule: always for
hand-written plans and under one_group, and for derived plans with a stream per pair in the
tests (they are safe by construction there, below; not with one stream per rank, where a send
can queue behind a receive from the other neighbour). The validator calls it before any
process starts.

The plan is derived, just in time and in schedule order. Number a rank's atomic actions
(an F&B pair counts as its two parts) 0..n-1; boundary i is the moment before part i
(boundary n: after the last). Each pair of ranks orders its messages by when their
consumer starts in the unit-cost dependency walk (one causal order of the whole step,
`message_order`), consumers that start together by when the producer started (the message
that exists first goes first: ordered the other way, interleaved 1F1B's rank 0 sent its
activations one action late, and its peer waited); both ranks issue them in that order:

  - a receive is posted `lookahead` parts before the part consuming it (0: just in time),
  - a send right after the part producing it,
  - either one no earlier than the operation before it in the pair's order (so a send may
    go out after a later part; a receive is never posted earlier than `lookahead`),
  - operations toward one peer at one boundary form one group.

Ordered by consumer start, everything a pair issues before a receive is issued by the
time its consumer runs, so with a stream per pair the plan never waits on itself, and at
most lookahead + 1 receive buffers are alive per rank, whatever the number of microbatches.

A hand-written schedule may instead spell its plan out with torch.distributed.pipelining's
communication actions (`0SEND_F3`, `1RECV_F3`, `1SEND_B3`, `0RECV_B3`), each posted on its
own where it is written; `p2p_check.check_plan` then refuses one that breaks the rules above, in one
line naming the two ranks and the two messages.

Imports no torch (a test enforces it for all of `schedules/`).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional

from pipetrain.schedules.deps import Walk, walk
from pipetrain.schedules.ir import Action, Comm, CommOp, Op, Schedule


# pipeline.p2p_transport -> the stream rule NCCL gives its batch_isend_irecv groups (p2p_check.STREAM_RULES):
# a 2-rank process group per pair of ranks that exchange tensors, or the pipeline's one process group.
TRANSPORT_STREAMS = {"pair_groups": "pair", "one_group": "rank"}


class PlanError(ValueError):
    """A point-to-point plan that NCCL would deadlock on or mismatch; names the ranks and messages."""


class Kind(str, enum.Enum):
    ACT = "act"  # forward output of `stage`
    GRAD = "grad"  # gradient w.r.t. the input of `stage`


class Message(NamedTuple):
    """One tensor crossing ranks. A tuple: plans of large schedules hash and compare millions."""

    kind: Kind
    stage: int  # the stage that produced it
    microbatch: int
    src: int
    dst: int

    def tag(self, num_microbatches: int) -> int:
        """A tag unique within one step (gloo matches by tag; NCCL ignores it)."""
        return (self.stage * num_microbatches + self.microbatch) * 2 + (self.kind is Kind.GRAD)

    def describe(self) -> str:
        what = "activation" if self.kind is Kind.ACT else "input gradient"
        return f"{what} of {self.stage}{'F' if self.kind is Kind.ACT else 'B'}{self.microbatch}"


Neighbours = tuple[tuple[Optional[int], Optional[int]], tuple[Optional[int], Optional[int]]]


def _neighbours(schedule: Schedule, rank: int, stage: int) -> Neighbours:
    """((prev stage, its rank), (next stage, its rank)), each (None, None) unless on another rank."""
    pl = schedule.placement

    def remote(other: Optional[int]) -> tuple[Optional[int], Optional[int]]:
        if other is None or pl.rank_of(other) == rank:
            return None, None
        return other, pl.rank_of(other)

    return remote(pl.prev_stage(stage)), remote(pl.next_stage(stage))


def _messages(a: Action, rank: int, nbrs: Neighbours) -> tuple[Optional[Message], Optional[Message]]:
    """(the message `a` consumes from another rank, the one it sends to another rank)."""
    s, m = a.stage, a.microbatch
    (prev, prev_rank), (nxt, next_rank) = nbrs
    if a.op is Op.F:  # activations flow down the chain
        need = None if prev is None else Message(Kind.ACT, prev, m, prev_rank, rank)
        send = None if nxt is None else Message(Kind.ACT, s, m, rank, next_rank)
    elif a.op.is_backward:  # gradients flow back up
        need = None if nxt is None else Message(Kind.GRAD, nxt, m, next_rank, rank)
        send = None if prev is None else Message(Kind.GRAD, s, m, rank, prev_rank)
    else:
        need = send = None
    return need, send


def sent_by(action: Action, schedule: Schedule, rank: int) -> Optional[Message]:
    """The message an action sends to another rank, if any."""
    return _messages(action, rank, _neighbours(schedule, rank, action.stage))[1]


def needed_by(action: Action, schedule: Schedule, rank: int) -> Optional[Message]:
    """The message an action must receive from another rank, if any."""
    return _messages(action, rank, _neighbours(schedule, rank, action.stage))[0]


class Group(NamedTuple):
    """Operations one rank posts together toward one peer: one step of that pair's order.
    A tuple like Message: a frozen dataclass's __init__ made up half of building plans at P=10^4."""

    peer: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True)
class RankTransfers:
    """One rank's transfers: its atomic actions and, per boundary, the P2P groups issued there."""

    rank: int
    parts: tuple[Action, ...]
    waits: tuple[Optional[Message], ...]  # waits[i]: the message part i consumes, if any
    issue: tuple[tuple[Group, ...], ...]  # issue[i]: posted before part i; issue[len(parts)]: after the last

    @property
    def max_pending_recvs(self) -> int:
        """Most receives issued and not yet consumed at once (the receive buffers alive)."""
        pending = peak = 0
        for i, groups in enumerate(self.issue):
            pending += sum(len(g.recvs) for g in groups)
            peak = max(peak, pending)
            if i < len(self.parts) and self.waits[i] is not None:
                pending -= 1
        return peak


def forward_plan(plan: RankTransfers) -> RankTransfers:
    """The plan of the forward-only pass (validation): the training plan with its backward
    parts and gradient messages dropped, groups kept at the next forward part.

    Dropping messages and merging groups that now stand at one boundary keeps both sides
    of every pair in one order, and the forward parts wait only for what they waited for
    in training, so the training plan's proof carries over; `p2p_check.check_plan` runs it anyway.
    """
    parts, waits, issue = [], [], [[]]
    for i, a in enumerate(plan.parts):
        for g in plan.issue[i]:
            issue[-1].append(g)
        if a.op is Op.F:
            parts.append(a)
            waits.append(plan.waits[i])
            issue.append([])
    issue[-1] += plan.issue[len(plan.parts)]
    out = []
    for groups in issue:
        merged: dict[int, tuple[list[Message], list[Message]]] = {}
        for g in groups:
            sends, recvs = merged.setdefault(g.peer, ([], []))
            sends += [m for m in g.sends if m.kind is Kind.ACT]
            recvs += [m for m in g.recvs if m.kind is Kind.ACT]
        out.append(tuple(Group(p, tuple(sd), tuple(rv)) for p, (sd, rv) in sorted(merged.items()) if sd or rv))
    return RankTransfers(plan.rank, tuple(parts), tuple(waits), tuple(out))


def comm_message(c: Comm, schedule: Schedule, rank: int) -> tuple[Message, bool]:
    """A hand-written communication as (message, is_send); PlanError if it cannot happen on this rank."""
    pl = schedule.placement
    if not 0 <= c.stage < pl.num_stages or pl.rank_of(c.stage) != rank:
        raise PlanError(f"{c} is on rank {rank}, but stage {c.stage} is not: write it in its stage's rank's row")
    forward = c.op in (CommOp.SEND_F, CommOp.RECV_F)
    send = c.op in (CommOp.SEND_F, CommOp.SEND_B)
    peer_stage = pl.next_stage(c.stage) if forward == send else pl.prev_stage(c.stage)
    if peer_stage is None or pl.rank_of(peer_stage) == rank:
        raise PlanError(f"{c}: that tensor does not cross ranks (stage {c.stage} has no neighbour on another rank "
                        f"that way): remove it")
    peer = pl.rank_of(peer_stage)
    kind = Kind.ACT if forward else Kind.GRAD
    producer = c.stage if send else peer_stage
    return Message(kind, producer, c.microbatch, rank if send else peer, peer if send else rank), send


def _explicit_plan(schedule: Schedule, rank: int) -> RankTransfers:
    """The plan a hand-written schedule spells out: each communication its own group, where written."""
    parts = tuple(schedule.actions(rank))
    needs = tuple(needed_by(a, schedule, rank) for a in parts)
    at: dict[int, list[Group]] = defaultdict(list)
    where: dict[tuple[Message, bool], int] = {}
    for b, c in schedule.comms[rank]:
        msg, send = comm_message(c, schedule, rank)
        if (msg, send) in where:
            raise PlanError(f"rank {rank} lists {c} twice: keep one")
        where[(msg, send)] = b
        at[b].append(Group(msg.dst if send else msg.src, (msg,) if send else (), () if send else (msg,)))
    for i, a in enumerate(parts):
        out = sent_by(a, schedule, rank)
        if out is not None and where.get((out, True), -1) <= i:
            raise PlanError(f"rank {rank} must send the {out.describe()} after {a}: add {a.stage}SEND_"
                            f"{'F' if out.kind is Kind.ACT else 'B'}{a.microbatch} after it")
        if needs[i] is not None and where.get((needs[i], False), i + 1) > i:
            raise PlanError(f"rank {rank} must receive the {needs[i].describe()} before {a}: add {a.stage}RECV_"
                            f"{'F' if needs[i].kind is Kind.ACT else 'B'}{a.microbatch} before it")
    expected = {(m, True) for m in (sent_by(a, schedule, rank) for a in parts) if m} | {(m, False) for m in needs if m}
    for msg, send in set(where) - expected:
        raise PlanError(f"rank {rank} {'sends' if send else 'receives'} the {msg.describe()}, which no action of "
                        f"rank {rank} {'produces' if send else 'consumes'}: remove it")
    return RankTransfers(rank, parts, needs, tuple(tuple(at.get(b, ())) for b in range(len(parts) + 1)))


Crossings = tuple[tuple[Action, Optional[Message], Optional[Message]], ...]  # per part: (action, consumes, sends)


def crossings(schedule: Schedule, rank: int) -> Crossings:
    """Each atomic action of the rank with the message it consumes and the one it sends, if any
    (neighbours looked up once per stage: the validator runs this on 10^5 actions)."""
    nbrs = {s: _neighbours(schedule, rank, s) for s in schedule.placement.stages_of(rank)}
    return tuple((a, *_messages(a, rank, nbrs[a.stage])) for a in schedule.actions(rank))


def exchange_pairs(schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """The pairs of ranks (a < b) that exchange tensors in a step, sorted: neighbours, the wrap-around
    of looped placements, mirror pairs, whatever the placement makes cross (the transport gives each
    its own process group). Derived from every rank's messages, so it holds for hand-written plans too."""
    pairs = set()
    for r in range(schedule.num_ranks):
        for _, need, _ in crossings(schedule, r):
            if need is not None:
                pairs.add((min(need.src, need.dst), max(need.src, need.dst)))
    return tuple(sorted(pairs))


def message_order(schedule: Schedule, result: Optional[Walk] = None,
                  per_rank: Optional[list[Crossings]] = None) -> dict[Message, tuple[float, float, int, int]]:
    """Every message's place in one causal order of the whole step: when its consumer starts
    in the unit-cost dependency walk, then when its producer started (of two messages whose
    consumers start together, the one produced first goes first: the other's sender need not hold
    back the receive of a message that already exists), then part and rank. Both ranks of a pair
    use it."""
    result = walk(schedule, lambda r, step: 1.0) if result is None else result
    if not result.complete:
        raise ValueError(f"schedule {schedule.name!r} deadlocks: validate it first")
    produced: dict[Message, float] = {}
    consumed: dict[Message, tuple[float, int, int]] = {}
    for r, steps in enumerate(schedule.steps):
        cross = iter(crossings(schedule, r) if per_rank is None else per_rank[r])
        for k, step in enumerate(steps):
            for part_no in range(len(step.parts())):
                _, need, out = next(cross)
                if need is not None:
                    consumed[need] = (result.start[r][k], part_no, r)
                if out is not None:
                    produced[out] = result.start[r][k]
    return {msg: (start, produced[msg], part_no, r) for msg, (start, part_no, r) in consumed.items()}


def build_plan(schedule: Schedule, rank: int, *, lookahead: int = 1,
               order: Optional[dict[Message, tuple[float, float, int, int]]] = None,
               cross: Optional[Crossings] = None) -> RankTransfers:
    """One rank's plan (see the module docstring); pure and deterministic.

    Toward each peer the rank issues its sends and receives in the pair's order
    (`message_order`: by when the consumer starts). A receive is posted `lookahead` parts
    before its consumer; a send right after the part producing it; either waits for the
    operation before it in the pair's order (a send may so go out later than produced,
    a receive is never posted earlier than `lookahead`). Operations toward one peer at
    one boundary form one group.
    """
    if lookahead < 0:
        raise ValueError(f"pipeline.p2p_lookahead must be >= 0, got {lookahead}")
    if schedule.comms:
        return _explicit_plan(schedule, rank)
    order = message_order(schedule) if order is None else order
    cross = crossings(schedule, rank) if cross is None else cross
    n = len(cross)
    # peer -> [(message, is_send, earliest boundary, latest boundary)]
    streams: dict[int, list[tuple[Message, bool, int, int]]] = defaultdict(list)
    for i, (_, need, out) in enumerate(cross):
        if out is not None:
            streams[out.dst].append((out, True, i + 1, n))
        if need is not None:
            streams[need.src].append((need, False, max(0, i - lookahead), i))
    at: dict[int, dict[int, tuple[list[Message], list[Message]]]] = defaultdict(dict)  # boundary -> peer -> ops
    for peer, ops in streams.items():
        ops.sort(key=lambda op: order[op[0]])
        b = 0
        for msg, is_send, earliest, latest in ops:
            b = max(b, earliest)
            # Ordered by consumer start, every earlier operation is issued before a receive's consumer.
            assert b <= latest, f"rank {rank}: {msg.describe()} issued after it is needed"
            sends, recvs = at[b].setdefault(peer, ([], []))
            (sends if is_send else recvs).append(msg)
    issue: list[tuple[Group, ...]] = [()] * (n + 1)
    for b, by_peer in at.items():
        issue[b] = tuple([Group(p, tuple(by_peer[p][0]), tuple(by_peer[p][1])) for p in sorted(by_peer)])
    parts, needs, _ = zip(*cross) if cross else ((), (), ())
    return RankTransfers(rank, tuple(parts), tuple(needs), tuple(issue))


def build_plans(schedule: Schedule, *, lookahead: int = 1,
                unit_walk: Optional[Walk] = None) -> tuple[RankTransfers, ...]:
    """Every rank's plan; `unit_walk`: the schedule's unit-cost walk if the caller has it."""
    if schedule.comms:
        return tuple(_explicit_plan(schedule, r) for r in range(schedule.num_ranks))
    per_rank = [crossings(schedule, r) for r in range(schedule.num_ranks)]
    order = message_order(schedule, unit_walk, per_rank)
    return tuple(build_plan(schedule, r, lookahead=lookahead, order=order, cross=per_rank[r])
                 for r in range(schedule.num_ranks))
