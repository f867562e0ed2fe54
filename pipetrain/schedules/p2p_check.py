"""Is a point-to-point plan safe on NCCL? The pure check the validator runs (no torch).

NCCL runs the operations between one pair of ranks in order, on one stream, and matches
the k-th send of a to b with the k-th receive of b from a. A plan (schedules/p2p.py) is
safe if (1) per direction, the sender sends in the order the receiver receives, (2) per
pair, both ranks issue their messages in one order (a group counting as one step), and
(3) running every rank's plan under those rules completes. Violations raise `PlanError`
in one line naming the two ranks and the two messages (or the stuck rank).
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Optional

from pipetrain.schedules.deps import Walk
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.p2p import Message, PlanError, RankPlan, build_plans, forward_plan


def _positions(plan: RankPlan) -> dict[tuple[int, bool], list[tuple[int, Message]]]:
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
    for a in range(len(pos)):
        for b in range(a + 1, len(pos)):
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


def _run_streams(plans: tuple[RankPlan, ...]) -> Optional[str]:
    """(3) Run every rank's plan under NCCL's rules; None if all completes, else who is stuck.

    A rank posts its groups at their boundaries and blocks before a part until the message
    it consumes has arrived. Per (rank, peer) stream, groups run one after another: a
    message completes once the groups holding it are the running (head) groups of both
    ranks' streams; a group completes when all its messages have, and then the next starts.
    Linear in the number of messages (each group becomes the head once).
    """
    groups: dict[tuple[int, int], list[tuple[Message, ...]]] = defaultdict(list)
    where: dict[tuple[Message, int], tuple[tuple[int, int], int]] = {}  # (message, rank) -> (stream, group)
    for plan in plans:
        for gs in plan.issue:
            for g in gs:
                key = (plan.rank, g.peer)
                msgs = g.sends + g.recvs
                for m in msgs:
                    where[(m, plan.rank)] = (key, len(groups[key]))
                groups[key].append(msgs)
    left = {key: [len(g) for g in gs] for key, gs in groups.items()}
    issued: dict[tuple[int, int], int] = defaultdict(int)
    head: dict[tuple[int, int], int] = defaultdict(int)
    done: set[Message] = set()
    waiting: dict[Message, int] = {}
    ready = deque(range(len(plans)))

    def running(key: tuple[int, int], k: int) -> bool:
        return head[key] == k < issued[key]

    def start(key: tuple[int, int]) -> None:
        """The head group of `key` may be running now: complete what it shares with running peers."""
        todo = [key]
        while todo:
            key = todo.pop()
            k = head[key]
            if k >= issued[key]:
                continue
            for m in groups[key][k]:
                other = where.get((m, m.dst if key[0] == m.src else m.src))
                if m in done or other is None or not running(*other):
                    continue
                done.add(m)
                if m in waiting:
                    ready.append(waiting.pop(m))
                for skey, sk in ((key, k), other):
                    left[skey][sk] -= 1
                    if left[skey][sk] == 0:
                        head[skey] += 1
                        todo.append(skey)

    pos = [0] * len(plans)  # next boundary of each rank to issue (then its part to run)
    posted = [False] * len(plans)  # whether the groups of boundary pos[r] are posted
    while ready:
        r = ready.popleft()
        plan = plans[r]
        while pos[r] <= len(plan.parts):
            i = pos[r]
            if not posted[r]:
                posted[r] = True
                for g in plan.issue[i]:
                    key = (r, g.peer)
                    issued[key] += 1
                    if head[key] == issued[key] - 1:
                        start(key)
            need = plan.waits[i] if i < len(plan.parts) else None
            if need is not None and need not in done:
                waiting[need] = r
                break
            pos[r] += 1
            posted[r] = False
    stuck = [r for r, p in enumerate(plans) if pos[r] <= len(p.parts)]
    if stuck:
        r = stuck[0]
        m = plans[r].waits[pos[r]]
        return f"rank {r} waits before {plans[r].parts[pos[r]]} for the {m.describe()} from rank {m.src}"
    for key, gs in sorted(groups.items()):
        if head[key] < len(gs):
            return (f"rank {key[0]}'s messages to rank {key[1]} never complete: "
                    + ", ".join(m.describe() for m in gs[head[key]] if m not in done))
    return None


def check_plan(schedule: Schedule, *, lookahead: int = 1, unit_walk: Optional[Walk] = None,
               run: Optional[bool] = None) -> None:
    """Raise PlanError unless the training and the forward-only plans are NCCL-safe.

    Rules (1) and (2) are always checked. Rule (3), running the plans under stream
    semantics, is what refuses a hand-written plan that deadlocks; a derived plan cannot
    (its order is causal, see the module docstring), so by default (run=None) it runs
    only for hand-written plans, keeping the validator light on 10^5-action schedules.
    The tests run it on every built-in schedule (run=True).
    """
    run = bool(schedule.comms) if run is None else run
    training = build_plans(schedule, lookahead=lookahead, unit_walk=unit_walk)
    # The forward plan only drops messages and merges groups at one boundary, which keeps
    # rules (1) and (2); it is checked again where rule (3) runs.
    for plans in (training, tuple(forward_plan(p) for p in training)) if run else (training,):
        pos = [_positions(p) for p in plans]
        _check_fifo(pos)
        _check_pair_order(pos)
        stuck = _run_streams(plans) if run else None
        if stuck is not None:
            raise PlanError(f"point-to-point plan deadlocks under NCCL's in-order rule: {stuck}")
