"""Data dependencies between actions, and one walk of a schedule in dependency order.

The rules (per microbatch m, with prev/next from the placement's chain):

  F(s, m)        needs F(prev(s), m)                   -- the stage input
  B/BW(s, m)     needs F(s, m) and grad(next(s), m)    -- its own activations, the output grad
                 (the chain's last stage needs only F: it computes the loss)
  W(s, m)        needs B(s, m)                         -- what B kept for the weight grad

`grad(s, m)` is produced by B or BW; `weights(s, m)` by W or BW.

`walk` runs every rank's list in order, each step starting when the rank is
free and all of its inputs exist (a blocking receive; sends never block). It is
the one engine behind both the deadlock check and the timing simulator, so the
validator and the simulator cannot disagree about what a schedule means.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from pipetrain.schedules.ir import Action, Op, Schedule, Step
from pipetrain.schedules.placement import Placement

# A fact that becomes true when an action finishes: ("F" | "grad" | "weights", stage, microbatch).
Key = tuple[str, int, int]


def provides(action: Action) -> tuple[Key, ...]:
    s, m = action.stage, action.microbatch
    if action.op is Op.F:
        return (("F", s, m),)
    if action.op is Op.B:
        return (("grad", s, m),)
    if action.op is Op.W:
        return (("weights", s, m),)
    return (("grad", s, m), ("weights", s, m))


def requires(action: Action, placement: Placement) -> tuple[Key, ...]:
    s, m = action.stage, action.microbatch
    if action.op is Op.F:
        prev = placement.prev_stage(s)
        return () if prev is None else (("F", prev, m),)
    if action.op is Op.W:
        return (("grad", s, m),)
    nxt = placement.next_stage(s)
    return (("F", s, m),) if nxt is None else (("F", s, m), ("grad", nxt, m))


@dataclass(frozen=True)
class Stuck:
    """Where a walk stopped: rank, index of its next step, and the facts that step waits for."""

    rank: int
    index: int
    waiting_for: tuple[Key, ...]


@dataclass(frozen=True)
class Walk:
    start: tuple[tuple[float, ...], ...]  # per rank, per step
    end: tuple[tuple[float, ...], ...]
    stuck: tuple[Stuck, ...]  # empty when every step ran

    @property
    def complete(self) -> bool:
        return not self.stuck


def walk(
    schedule: Schedule,
    duration: Callable[[int, Step], float],
    *,
    comm_ms: float = 0.0,
) -> Walk:
    """Time every step: start = max(rank free, each input's finish (+ comm_ms across ranks)).

    Ranks are woken only when a fact they wait for appears, so the cost is linear in
    the number of steps. Start times do not depend on the order ranks are visited
    (it is a longest-path computation over a DAG).
    """
    placement = schedule.placement
    steps = schedule.steps
    n_ranks = len(steps)
    done: dict[Key, tuple[float, int]] = {}  # fact -> (finish time, rank that produced it)
    waiters: dict[Key, list[int]] = {}
    pos = [0] * n_ranks
    free = [0.0] * n_ranks
    start: list[list[float]] = [[] for _ in range(n_ranks)]
    end: list[list[float]] = [[] for _ in range(n_ranks)]
    queue = deque(range(n_ranks))
    queued = [True] * n_ranks
    while queue:
        r = queue.popleft()
        queued[r] = False
        while pos[r] < len(steps[r]):
            step = steps[r][pos[r]]
            t = free[r]
            missing = None
            for part in step.parts():
                for key in requires(part, placement):
                    got = done.get(key)
                    if got is None:
                        missing = key
                        break
                    finish, src = got
                    t = max(t, finish + (comm_ms if src != r else 0.0))
                if missing is not None:
                    break
            if missing is not None:
                waiters.setdefault(missing, []).append(r)
                break
            finish = t + duration(r, step)
            start[r].append(t)
            end[r].append(finish)
            free[r] = finish
            pos[r] += 1
            for part in step.parts():
                for key in provides(part):
                    done[key] = (finish, r)
                    for w in waiters.pop(key, ()):
                        if not queued[w]:
                            queued[w] = True
                            queue.append(w)
    stuck = []
    for r in range(n_ranks):
        if pos[r] < len(steps[r]):
            step = steps[r][pos[r]]
            need = tuple(
                k for part in step.parts() for k in requires(part, placement) if k not in done
            )
            stuck.append(Stuck(r, pos[r], need))
    return Walk(tuple(map(tuple, start)), tuple(map(tuple, end)), tuple(stuck))
