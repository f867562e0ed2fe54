"""`zb_auto`: a memory-capped zero-bubble schedule, found greedily for the given costs.

After the Zero Bubble paper's automatic scheduling (Qi et al., ICLR 2024, arXiv 2401.10241,
Section 3.1 and Appendix B), our own code. Given each stage's F, B (input grad) and W (weight
grad) time, the point-to-point latency and each rank's activation budget (in microbatches'
worth of one stage's activations), it places the passes microbatch by microbatch, so every
pass's start time is known when it is placed:

  1. warm-up: before B(0), every stage runs as many forwards as its budget holds and the time
     until B(0)'s gradient arrives allows (the paper's rule 1 and Appendix B), fewer than the
     stage feeding it;
  2. round i: each stage runs its next forward (stage 0 first), then B(i) (last stage first);
  3. W passes go in front of a pass when memory needs them (rule 3: W frees what B kept), when
     they end before that pass's input arrives (rule 2: they fill the bubble without delaying
     the critical path), and, depending on a knob, into a smaller gap too;
  4. the W passes left at the end fill the tail (rule 4).

Two knobs (how far a warm-up F may overrun B(0)'s arrival; whether W goes into gaps it
overruns) give nine candidate orders; the one with the least step time + longest stage span
wins, as the paper's heuristic keeps the best of its variants before its ILP refinement
(Appendix G, not done here).

The memory of a microbatch on a stage: +1 at its F, -(1 - w_keep) at its B, -w_keep at its
W (the paper's M_B and M_W = w_keep x M_B). The default w_keep = 1 counts a set live from F
to W, as the simulator does (schedules/simulate.py), so the budget bounds the simulator's
peak. The timing rule is the simulator's (a step starts when its rank is free and its inputs
have arrived, `comm` after they were produced), so re-simulating the order gives the times
the search saw. The paper's ILP refinement (Appendix G) is not done.

The registry entry (no costs known) builds it for F = B = W = 1 ms, comm 0 and ZB-H2's budget
of 2P-1; plan.py builds it with the run's own stage costs and `schedule.memory_budget`.
Pure Python, no torch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from pipetrain.schedules.ir import Action, Op
from pipetrain.schedules.spec import ScheduleSpec, check_basic, require

_EPS = 1e-9
Costs = Union[float, Sequence[float]]


def _per_stage(x: Costs, P: int, what: str) -> list[float]:
    vals = [float(x)] * P if isinstance(x, (int, float)) else [float(v) for v in x]
    if len(vals) != P:
        raise ValueError(f"zb_auto: {what} needs one value per stage ({P}), got {len(vals)}")
    if min(vals) < 0:
        raise ValueError(f"zb_auto: {what} times must be >= 0 ms")
    return vals


def default_budget(P: int) -> float:
    """ZB-H2's peak live activation sets, 2P-1: the budget at which the paper's ZB-2p is near zero bubble."""
    return float(2 * P - 1)


class _Builder:
    """One pass of the heuristic under one choice of its two knobs; `order[j]` is stage j's list.

    Passes are placed microbatch by microbatch: in round i every stage places its forwards
    (stage 0 first), then B(i) (last stage first). A pass's inputs are then always placed
    before it, so its start time is known exactly when it is placed: max(stage free,
    input end + comm), the simulator's rule.
    """

    def __init__(self, P: int, M: int, costs: tuple[list[float], list[float], list[float]], comm: float,
                 budget: list[float], w_keep: list[float], *, overrun: float, fill_small_gaps: int) -> None:
        self.P, self.M, self.comm = P, M, comm
        self.cost = {Op.F: costs[0], Op.B: costs[1], Op.W: costs[2]}
        self.budget, self.w_keep = budget, w_keep
        self.overrun, self.fill_small_gaps = overrun, fill_small_gaps
        self.free = [0.0] * P  # when each stage's rank is free
        self.end: dict[tuple[Op, int, int], float] = {}
        self.nf = [0] * P
        self.nw = [0] * P  # W runs in B order: W(j, nw) is the oldest pending
        self.nb = [0] * P
        self.live = [0.0] * P
        self.idle = [0.0] * P  # bubble so far, after each stage's first pass
        self.order: list[list[Action]] = [[] for _ in range(P)]

    def ready(self, op: Op, j: int, m: int) -> float:
        """When (op, j, m)'s input from the neighbouring stage is there (its producer is placed)."""
        if op is Op.F and j > 0:
            return self.end[(Op.F, j - 1, m)] + self.comm
        if op is Op.B and j < self.P - 1:
            return self.end[(Op.B, j + 1, m)] + self.comm
        return 0.0

    def put(self, op: Op, j: int) -> None:
        m = {Op.F: self.nf, Op.B: self.nb, Op.W: self.nw}[op][j]
        start = max(self.free[j], self.ready(op, j, m))
        if self.order[j]:
            self.idle[j] += start - self.free[j]
        self.free[j] = self.end[(op, j, m)] = start + self.cost[op][j]
        self.order[j].append(Action(op, j, m))
        if op is Op.F:
            self.nf[j] += 1
            self.live[j] += 1.0
        elif op is Op.B:
            self.nb[j] += 1
            self.live[j] -= 1.0 - self.w_keep[j]
        else:
            self.nw[j] += 1
            self.live[j] -= self.w_keep[j]

    def fits_f(self, j: int) -> bool:
        return self.live[j] + 1.0 <= self.budget[j] + _EPS

    def fill_before(self, op: Op, j: int, m: int) -> None:
        """W passes before (op, j, m): as many as memory needs, then those that end before its
        input arrives; one more into a smaller gap when this stage's bubble is not the largest
        (the paper's rule: a W that delays the pass a little is better than growing the worst bubble)."""
        while op is Op.F and not self.fits_f(j) and self.nw[j] < self.nb[j]:
            self.put(Op.W, j)
        at = self.ready(op, j, m)
        while self.nw[j] < self.nb[j] and self.free[j] + self.cost[Op.W][j] <= at + _EPS:
            self.put(Op.W, j)
        gap = at - self.free[j]
        small = self.fill_small_gaps == 2 or (self.fill_small_gaps == 1 and gap <= max(self.idle) - self.idle[j])
        if small and self.nw[j] < self.nb[j] and gap > _EPS:
            self.put(Op.W, j)

    def warmup(self) -> list[int]:
        """Forwards per stage before B(0): as many as fit in memory and in the time until B(0)'s
        gradient arrives (the paper's rule 1 and Appendix B), computed from the last stage up."""
        extra, arrive = [0] * self.P, 0.0
        clock = [self.end[(Op.F, j, 0)] for j in range(self.P)]
        for j in range(self.P - 1, -1, -1):
            if j == self.P - 1:
                arrive = clock[j]
            else:
                live, t = 1.0, clock[j]
                while self.nf[j] + extra[j] < self.M and live + 1.0 <= self.budget[j] + _EPS:
                    f = self.cost[Op.F][j]
                    # an F may overrun B(0)'s arrival by `overrun` of itself; stage 0's B feeds no one
                    overrun = 1.0 if j == 0 else self.overrun
                    slack = arrive - t - (1.0 - overrun) * f
                    if (slack < -_EPS) if overrun == 0.0 else (slack <= _EPS):
                        break
                    t, live, extra[j] = t + f, live + 1.0, extra[j] + 1
                clock[j] = t
            if j > 0:
                arrive = max(clock[j], arrive) + self.cost[Op.B][j] + self.comm
        for j in range(1, self.P):  # fewer than the stage feeding it: an extra F there only delays B
            extra[j] = min(extra[j], max(extra[j - 1] - 1, 0))
        return extra

    def solve(self) -> list[list[Action]]:
        for j in range(self.P):
            self.put(Op.F, j)
        for j, n in enumerate(self.warmup()):
            for _ in range(n):
                self.put(Op.F, j)
        for i in range(self.M):
            if i > 0:
                for j in range(self.P):
                    behind = j > 0 and self.nf[j] >= self.nf[j - 1]
                    if (self.nf[j] < self.M and not behind
                            and (self.fits_f(j) or self.nw[j] < self.nb[j] or self.nf[j] <= i)):
                        self.fill_before(Op.F, j, self.nf[j])
                        self.put(Op.F, j)
            for j in range(self.P - 1, -1, -1):
                while self.nf[j] <= i:  # B(i) needs F(j, i): flush W's for memory and run it
                    self.fill_before(Op.F, j, self.nf[j])
                    self.put(Op.F, j)
                self.fill_before(Op.B, j, i)
                self.put(Op.B, j)
        for j in range(self.P):
            while self.nw[j] < self.M:
                self.put(Op.W, j)
        return self.order

    def score(self) -> tuple[float, float]:
        """(step time with every rank starting at 0, the paper's cost: the longest span of one stage)."""
        first = [self.end[(Op.F, j, 0)] - self.cost[Op.F][j] for j in range(self.P)]
        return max(self.free), max(e - s for e, s in zip(self.free, first))


def zb_auto_order(
    P: int, M: int, *, f: Costs = 1.0, b: Costs = 1.0, w: Costs = 1.0, comm: float = 0.0,
    budget: Optional[Union[float, Sequence[float]]] = None, w_keep: Costs = 1.0,
) -> list[list[Action]]:
    """Per rank (= stage, loop placement, one stage per rank), the greedy zero-bubble order.

    `budget`: each rank's activation budget in microbatches (one number for all, or one per
    rank); None: 2P-1 (ZB-H2's). `w_keep`: the share of a microbatch's activations B keeps for W
    (one number, or one per stage: 1 on a recomputing stage, whose kept inputs live until W).
    """
    check_basic("zb_auto", P, M)
    budgets = _per_stage(default_budget(P) if budget is None else budget, P, "budget")
    require(min(budgets) >= 1.0, f"zb_auto needs an activation budget of at least 1 microbatch per rank "
                                 f"(got {min(budgets)}): raise schedule.memory_budget")
    keeps = _per_stage(w_keep, P, "w_keep")
    require(all(0.0 <= k <= 1.0 for k in keeps), f"zb_auto: w_keep must be in [0, 1] (got {w_keep})")
    if comm < 0:
        raise ValueError(f"zb_auto: comm must be >= 0 ms (got {comm})")
    costs = (_per_stage(f, P, "F"), _per_stage(b, P, "B"), _per_stage(w, P, "W"))
    best: Optional[_Builder] = None
    # The heuristic's two knobs; keep the order with the least step time + longest stage span (the
    # step time when every rank starts at 0, as our executor runs; the span when steps overlap, the
    # paper's cost). All start offsets are alike, so the span is what separates the candidates.
    for overrun in (0.0, 0.5, 1.0):
        for fill in (0, 1, 2):  # W into a gap it overruns: never, unless it grows the worst bubble, always
            cand = _Builder(P, M, costs, float(comm), budgets, keeps, overrun=overrun, fill_small_gaps=fill)
            cand.solve()
            if best is None or sum(cand.score()) < sum(best.score()):
                best = cand
    assert best is not None
    return best.order


def zb_auto(P: int, M: int, v: int = 1) -> list[list[Action]]:
    """Registry form (no costs known): F = B = W = 1 ms, comm 0, budget 2P-1."""
    return zb_auto_order(P, M)


def check_zb_auto(P: int, M: int, v: int = 1) -> None:
    check_basic("zb_auto", P, M)
    require(v == 1, f"zb_auto runs exactly 1 stage per rank (got {v}): leave schedule.virtual_stages at 1")


SPECS: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(
        name="zb_auto",
        placement_kind="loop",
        generate=zb_auto,
        check=check_zb_auto,
        description=(
            "Zero-bubble schedule searched greedily for the run's F, B, W and P2P costs under a per-rank "
            "activation budget (schedule.memory_budget; default 2P-1, ZB-H2's), "
            "after Qi et al. 2024's automatic scheduling."
        ),
        fixed_stages_per_rank=1,
        analytic_bubble=None,
    ),
)
