"""Is a point-to-point plan safe on NCCL? The pure check the validator runs (no torch).

NCCL matches the k-th send of a to b with the k-th receive of b from a, and runs each
`batch_isend_irecv` group as kernels on a stream, in issue order: the stream of the
process group the group is posted on. With a process group per pair of ranks
(`pipeline.p2p_transport=pair_groups`) that is one stream per pair; with one process group
for the pipeline (`one_group`) every group of a rank, to any peer, queues on one stream
(ProcessGroupNCCL's `batchP2P` picks the device's communicator), so a send can wait behind
a receive from the other neighbour. A plan (schedules/p2p.py) is safe if (1) per direction,
the sender sends in the order the receiver receives, (2) per pair, both ranks issue their
messages in one order (a group counting as one step), and (3) running every rank's plan
under the transport's stream rule (`streams`: "pair" or "rank") completes. Violations raise
`PlanError` in one line naming the two ranks and the two messages, or, for (3), the stuck
rank and the chain of messages that holds it up.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Literal, Optional

from pipetrain.schedules.deps import Walk
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.p2p import Message, PlanError, RankTransfers, build_plans, forward_plan


Streams = Literal["pair", "rank"]
# How NCCL runs a rank's batch_isend_irecv groups: a process group per pair of ranks gives each pair
# its own communicator and stream; one process group puts all of a rank's groups on one stream.
STREAM_RULES = {"pair": "one stream per pair of ranks", "rank": "one stream per rank"}


def _positions(plan: RankTransfers) -> dict[tuple[int, bool], list[tuple[int, Message]]]:
    """(peer, is_send) -> [(group number on the pair's stream, message)] in issue order."""
    out: dict[tuple[int, bool], list[tuple[int, Message]]] = defaultdict(list)
    count: dict[int, int] = defaultdict(int)
    for groups in plan.issue:
        for g in groups:
            k = count[g.peer]
            count[g.peer] = k + 1
            for is_send, msgs in ((True, g.sends), (False, g.recvs)):
                if msgs:
                    seq = out[(g.peer, is_send)]
                    for m in msgs:
                        seq.append((k, m))
    return out


def _check_fifo(pos: list[dict]) -> None:
    """(1) The k-th send of a to b is the k-th receive of b from a (NCCL matches by position)."""
    for a, mine in enumerate(pos):
        for (b, is_send), sent in sorted(mine.items()):
            if not is_send:
                continue
            got = [m for _, m in pos[b].get((a, False), [])]
            if got == [m for _, m in sent]:
                continue
            for k, (_, m) in enumerate(sent):
                if k >= len(got) or got[k] != m:
                    other = got[k].describe() if k < len(got) else "nothing"
                    raise PlanError(
                        f"ranks {a} and {b} disagree on the order of two messages: rank {a} sends the {m.describe()} "
                        f"as its message #{k} to rank {b}, but rank {b} receives the {other} there; NCCL matches "
                        f"messages between two ranks in order: make rank {b} receive them in the order rank {a} "
                        f"sends them")


def _check_pair_order(pos: list[dict]) -> None:
    """(2) Both sides of a pair issue its messages in one order (a group counts as one step)."""
    # Only pairs that exchange messages (each rank's peers): all pairs would be quadratic in P.
    pairs = sorted({(min(a, peer), max(a, peer)) for a, mine in enumerate(pos) for peer, _ in mine})
    for a, b in pairs:
        at: dict[Message, list[int]] = defaultdict(lambda: [0, 0])
        for side, (r, peer) in enumerate(((a, b), (b, a))):
            for is_send in (True, False):
                for k, m in pos[r].get((peer, is_send), []):
                    at[m][side] = k
        rows = sorted(((ka, kb, m) for m, (ka, kb) in at.items()), key=lambda t: (t[0], t[1]))
        best: Optional[tuple[int, int, Message]] = None  # the row with the largest kb among earlier ka
        prev_ka, group_best = None, None
        for ka, kb, m in rows:
            if ka != prev_ka:
                if group_best is not None and (best is None or group_best[1] > best[1]):
                    best = group_best
                prev_ka, group_best = ka, None
            if best is not None and kb < best[1]:
                x = best[2]
                raise PlanError(
                    f"ranks {a} and {b} issue two messages in opposite orders: rank {a} issues the {x.describe()} "
                    f"before the {m.describe()}, rank {b} the other way round; on NCCL (one in-order stream "
                    f"per pair) that deadlocks: reorder the schedule so both ranks meet them in one order")
            if group_best is None or kb > group_best[1]:
                group_best = (ka, kb, m)


Key = tuple[int, ...]  # a stream: (rank, peer) with a stream per pair, (rank,) with one per rank


class _Streams:
    """(3) Every rank's plan run under NCCL's rules, with `streams` giving the stream rule.

    A rank posts its groups at their boundaries and blocks before a part until the message
    it consumes has arrived. Per stream, groups run one after another: a message completes
    once the groups holding it are the running (head) groups of both ranks' streams; a group
    completes when all its messages have, and then the next starts. Linear in the number of
    messages (each group becomes the head once).
    """

    def __init__(self, plans: tuple[RankTransfers, ...], streams: Streams) -> None:
        self.plans = plans
        self.key = (lambda r, peer: (r, peer)) if streams == "pair" else (lambda r, peer: (r,))
        self.groups: dict[Key, list[tuple[Message, ...]]] = defaultdict(list)
        self.where: dict[tuple[Message, int], tuple[Key, int]] = {}  # (message, rank) -> (stream, group)
        for plan in plans:
            for gs in plan.issue:
                for g in gs:
                    key = self.key(plan.rank, g.peer)
                    msgs = g.sends + g.recvs
                    for m in msgs:
                        self.where[(m, plan.rank)] = (key, len(self.groups[key]))
                    self.groups[key].append(msgs)
        self.left = {key: [len(g) for g in gs] for key, gs in self.groups.items()}
        self.issued: dict[Key, int] = defaultdict(int)
        self.head: dict[Key, int] = defaultdict(int)
        self.done: set[Message] = set()
        self.waiting: dict[Message, int] = {}
        self.ready = deque(range(len(plans)))
        self.pos = [0] * len(plans)  # next boundary of each rank to issue (then its part to run)

    def _running(self, key: Key, k: int) -> bool:
        return self.head[key] == k < self.issued[key]

    def _start(self, key: Key) -> None:
        """The head group of `key` may be running now: complete what it shares with running peers."""
        todo = [key]
        while todo:
            key = todo.pop()
            k = self.head[key]
            if k >= self.issued[key]:
                continue
            for m in self.groups[key][k]:
                other = self.where.get((m, m.dst if key[0] == m.src else m.src))
                if m in self.done or other is None or not self._running(*other):
                    continue
                self.done.add(m)
                if m in self.waiting:
                    self.ready.append(self.waiting.pop(m))
                for skey, sk in ((key, k), other):
                    self.left[skey][sk] -= 1
                    if self.left[skey][sk] == 0:
                        self.head[skey] += 1
                        todo.append(skey)

    def run(self) -> Optional[str]:
        """None if every plan completes, else one line saying who is stuck and why."""
        posted = [False] * len(self.plans)  # whether the groups of boundary pos[r] are posted
        while self.ready:
            r = self.ready.popleft()
            plan = self.plans[r]
            while self.pos[r] <= len(plan.parts):
                i = self.pos[r]
                if not posted[r]:
                    posted[r] = True
                    for g in plan.issue[i]:
                        key = self.key(r, g.peer)
                        self.issued[key] += 1
                        if self.head[key] == self.issued[key] - 1:
                            self._start(key)
                need = plan.waits[i] if i < len(plan.parts) else None
                if need is not None and need not in self.done:
                    self.waiting[need] = r
                    break
                self.pos[r] += 1
                posted[r] = False
        stuck = [r for r, p in enumerate(self.plans) if self.pos[r] <= len(p.parts)]
        if stuck:
            return self._why(stuck[0])
        for key, gs in sorted(self.groups.items()):
            if self.head[key] < len(gs):
                return (f"rank {key[0]}'s messages to rank {gs[self.head[key]][0].dst if len(key) == 1 else key[1]} "
                        f"never complete: " + ", ".join(m.describe() for m in gs[self.head[key]] if m not in self.done))
        return None

    def _stuck_at(self, r: int) -> tuple[str, Message]:
        m = self.plans[r].waits[self.pos[r]]
        assert m is not None
        return f"waits before {self.plans[r].parts[self.pos[r]]} for the {m.describe()} from rank {m.src}", m

    def _why(self, r: int) -> str:
        """Rank r is stuck: follow what holds up its message (a rank stuck before posting it, or a
        group queued ahead of it on a stream) until a message repeats: the cycle, in one line."""
        text, m = self._stuck_at(r)
        out, seen = [f"rank {r} {text}"], set()
        while m not in seen and len(out) <= 4 * len(self.plans):
            seen.add(m)
            for side in (m.src, m.dst):
                verb = "send" if side == m.src else "receive"
                key, k = self.where[(m, side)]
                if k >= self.issued[key]:  # not posted yet: that rank is stuck before the boundary
                    text, m = self._stuck_at(side)
                    out.append(f"rank {side} has not posted its {verb} of it: it {text}")
                    break
                if self.head[key] < k:  # queued behind an unfinished group on the same stream
                    x = next(x for x in self.groups[key][self.head[key]] if x not in self.done)
                    mine = "send" if x.src == side else "receive"
                    out.append(f"rank {side} queued its {verb} of it behind its {mine} of the {x.describe()} "
                               f"{'to' if mine == 'send' else 'from'} rank {x.dst if mine == 'send' else x.src}")
                    m = x
                    break
            else:  # both sides run it: it would have completed
                raise AssertionError(f"{m.describe()} runs on both ranks but never completes")
        return "; ".join(out)


def _run_streams(plans: tuple[RankTransfers, ...], streams: Streams = "pair") -> Optional[str]:
    """(3) Run every rank's plan under NCCL's rules; None if all completes, else who is stuck and why."""
    return _Streams(plans, streams).run()


def check_plan(schedule: Schedule, *, lookahead: int = 1, unit_walk: Optional[Walk] = None,
               run: Optional[bool] = None, streams: Streams = "pair") -> None:
    """Raise PlanError unless the training and the forward-only plans are NCCL-safe under `streams`.

    Rules (1) and (2) are always checked. Rule (3), running the plans under stream
    semantics, is what refuses a hand-written plan that deadlocks; a derived plan cannot
    with a stream per pair (its order is causal, see p2p.py's docstring), so by default
    (run=None) it runs only for hand-written plans and with one stream per rank, where a
    derived plan is not safe by construction (a send may queue behind a receive from the
    other neighbour). It is linear in the messages; the tests run it on every built-in
    schedule (run=True).
    """
    if streams not in STREAM_RULES:
        raise ValueError(f"streams must be one of {sorted(STREAM_RULES)} (got {streams!r})")
    run = (bool(schedule.comms) or streams == "rank") if run is None else run
    training = build_plans(schedule, lookahead=lookahead, unit_walk=unit_walk)
    # The forward plan only drops messages and merges groups at one boundary, which keeps
    # rules (1) and (2); it is checked again where rule (3) runs.
    for plans in (training, tuple(forward_plan(p) for p in training)) if run else (training,):
        pos = [_positions(p) for p in plans]
        _check_fifo(pos)
        _check_pair_order(pos)
        stuck = _run_streams(plans, streams) if run else None
        if stuck is not None:
            what = "forward-only point-to-point plan" if plans is not training else "point-to-point plan"
            raise PlanError(f"{what} deadlocks on NCCL with {STREAM_RULES[streams]}: {stuck}")
