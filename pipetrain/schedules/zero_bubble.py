"""Zero-bubble schedules: ZB-H1, ZB-H2 and ZB-V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, Sections 3 and 6; reference code sail-sg/zero-bubble-pipeline-parallelism).

All three split the backward into B (input grad, on the critical path: the previous
stage waits for it) and W (weight grad, which nobody waits for), and use the W passes
as filler for what would otherwise be pipeline bubble. None of them emits a BW.

  zbh1  loop placement, 1 stage per rank. 1F1B's warm-up, but rank r holds back its
        first r W passes and runs them in the tail (paper Fig. 3 top; the sail-sg
        zb-h1-quick-start branch's "delay W by rank"). Needs M >= P. Idle per rank
        (P-1)(F+B-W) when W <= min(F, B), in general (P-1) max(F+B-W, F, B);
        peak live activation sets P on every rank.
  zbh2  loop placement, 1 stage per rank. Warm-up of 2(P-r)-1 forwards on rank r so
        no rank idles before its first B, and 2r W passes held back for the tail
        (paper Fig. 3 bottom). Needs M >= 2P-1. The paper's (P-1)(F+B-2W) assumes
        the optimizer-step synchronisation is removed (post-validation with
        rollback, paper Section 4), which we do not model: every rank starts at time
        0 and the step ends when the last rank finishes, so the last rank's (P-1)F
        start-up wait stays idle time. Measured in our simulator (comm 0, M >= 2P-1):
        idle per rank (P-1) max(F+B-2W, F, B-F), never more than ZB-H1's; with
        F=B=W that is (P-1)F, equal to ZB-H1. Peak live activation sets 2P-1.
  zbv   V placement (rank r holds stages r and 2P-1-r, each half a rank's share), the
        handcrafted ZB-V of paper Section 6 in the phase order of torch's
        ScheduleZBVZeroBubble: warm-up on the down-going stage, a steady F B W on
        both stages, then a cool-down that parks W passes to fill the tail. Any
        M >= 1 (built for max(M, 2P-1), extra microbatches dropped, as torch does).
        Peak live activation sets <= 2P (each half the size of a ZB-H1 set).

Costs in the docstrings: F, B, W are one microbatch through one rank's share of the
model (spec.RankCosts). Pure Python, no torch.
"""

from __future__ import annotations

from pipetrain.schedules.ir import Action, Op
from pipetrain.schedules.spec import RankCosts, ScheduleSpec, check_basic, require

_KNOB_M = "pipeline.microbatches"


# ---------------------------------------------------------------- one stage per rank
def _single_stage_rank(rank: int, M: int, *, warmup: int, w_delay: int) -> list[Action]:
    """One rank's list for a one-stage-per-rank zero-bubble schedule (stage id == rank).

    `warmup` forwards first; then, for every microbatch k in order, B(k), then the
    oldest pending W once `w_delay` B passes are ahead of it, then the next forward.
    The W passes held back (min(w_delay, M) of them) run at the end, where they fill
    the tail bubble that 1F1B leaves on this rank (paper Fig. 3).
    """
    s = rank
    out = [Action(Op.F, s, m) for m in range(min(warmup, M))]
    next_f, next_w = len(out), 0
    for k in range(M):
        out.append(Action(Op.B, s, k))
        if k >= w_delay:
            out.append(Action(Op.W, s, next_w))
            next_w += 1
        if next_f < M:
            out.append(Action(Op.F, s, next_f))
            next_f += 1
    out.extend(Action(Op.W, s, m) for m in range(next_w, M))
    return out


def zbh1(P: int, M: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1: rank r runs P-r forwards, then B / (W once r B's ahead) / F (paper Fig. 3 top).

    Same warm-up as 1F1B, so the same in-flight microbatches; the last rank pairs
    F and B back to back for its first P-1 microbatches, so the B passes travel up
    the pipeline without waiting for W, and every rank's tail is filled by the W
    passes it held back. Matches the sail-sg zb-h1-quick-start rule "delay W by rank".
    """
    return [_single_stage_rank(r, M, warmup=P - r, w_delay=r) for r in range(P)]


def zbh2(P: int, M: int, v: int = 1) -> list[list[Action]]:
    """ZB-H2: rank r runs 2(P-r)-1 forwards, then B / (W once 2r B's ahead) / F (paper Fig. 3 bottom).

    The P-1-r extra forwards fill the gap in which ZB-H1's rank r waits for its first
    B (P-1-r op-times with F=B=W); holding back 2r W passes fills the tail. Peak live
    activation sets 2P-1 on every rank when M >= 2P-1 (the paper's (2p-1) M_B).
    """
    return [_single_stage_rank(r, M, warmup=2 * (P - r) - 1, w_delay=2 * r) for r in range(P)]


# ---------------------------------------------------------------- ZB-V
class _VRank:
    """Counters of one rank's two stages under the V placement: chunk 0 = stage r
    (going down the ranks), chunk 1 = stage 2P-1-r (coming back up)."""

    def __init__(self, P: int, rank: int) -> None:
        self.stage = (rank, 2 * P - 1 - rank)
        self.f = [0, 0]
        self.b = [0, 0]
        self.w = [0, 0]
        self.out: list[Action] = []

    def emit(self, op: Op, chunk: int) -> None:
        count = {Op.F: self.f, Op.B: self.b, Op.W: self.w}[op]
        self.out.append(Action(op, self.stage[chunk], count[chunk]))
        count[chunk] += 1

    def fbw(self, chunk: int) -> None:
        """F, B and W of the next microbatch on one chunk, back to back."""
        for op in (Op.F, Op.B, Op.W):
            self.emit(op, chunk)


def _zbv_rank(P: int, rank: int, n: int) -> list[Action]:
    """One rank of ZB-V for n >= 2P-1 microbatches (torch's ScheduleZBVZeroBubble phases).

    Warm-up: 2(P-r)-1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then
    P-r rounds of F B W on chunk 1 (the loss sits on rank 0's chunk 1, so chunk-1
    gradients start flowing first). Steady: F B W on chunk 0, then F B W on chunk 1,
    until all forwards are done. Cool-down: r pairs of B (chunk 0, chunk 1) with W
    parked, then P-r rounds of B W on chunk 0, then the parked W's, chunk 1 first.
    """
    q = _VRank(P, rank)
    for _ in range(2 * (P - rank) - 1):
        q.emit(Op.F, 0)
    for _ in range(rank):
        q.emit(Op.F, 1)
        q.emit(Op.F, 0)
    for _ in range(P - rank):
        q.fbw(1)
    while q.f[1] < q.f[0] or q.f[0] < n:
        if q.f[0] < n:
            q.emit(Op.F, 0)
        q.emit(Op.B, 0)
        q.emit(Op.W, 0)
        q.fbw(1)
    for _ in range(rank):
        q.emit(Op.B, 0)
        q.emit(Op.B, 1)
    for _ in range(P - rank):
        q.emit(Op.B, 0)
        q.emit(Op.W, 0)
    while q.w[1] < q.b[1]:
        q.emit(Op.W, 1)
    while q.w[0] < q.b[0]:
        q.emit(Op.W, 0)
    assert q.f == q.b == q.w == [n, n], (rank, q.f, q.b, q.w)
    return q.out


def zbv(P: int, M: int, v: int = 2) -> list[list[Action]]:
    """ZB-V on the V placement: rank r holds stages r and 2P-1-r (paper Section 6)."""
    n = max(M, 2 * P - 1)
    # With fewer than 2P-1 microbatches, build the schedule for 2P-1 and drop the
    # extra microbatches (as torch does): a microbatch's actions depend only on
    # that microbatch's other actions, so removing whole microbatches keeps the
    # order deadlock-free.
    return [[a for a in _zbv_rank(P, r, n) if a.microbatch < M] for r in range(P)]


# ---------------------------------------------------------------- constraints
def _check_one_stage(name: str, v: int) -> None:
    require(v == 1, f"{name} runs exactly 1 stage per rank (got {v}): leave schedule.virtual_stages at 1")


def check_zbh1(P: int, M: int, v: int = 1) -> None:
    """M >= P: with fewer microbatches the pipeline never fills (same rule as torch's
    Schedule1F1B), the tail has too few W passes to fill, and neither the bubble
    formula nor the peak of P live activation sets holds."""
    check_basic("zbh1", P, M)
    _check_one_stage("zbh1", v)
    require(
        M >= P,
        f"zbh1 needs {_KNOB_M} >= pipeline.degree so the pipeline fills (got {M} < {P}): "
        f"set {_KNOB_M} to at least {P}",
    )


def check_zbh2(P: int, M: int, v: int = 1) -> None:
    """M >= 2P-1: rank 0's warm-up is 2P-1 forwards (paper Fig. 3 bottom). With fewer
    microbatches the warm-up is cut short and the schedule can lose to ZB-H1 (it does
    in our simulator for P <= M <= 2P-3)."""
    check_basic("zbh2", P, M)
    _check_one_stage("zbh2", v)
    need = 2 * P - 1
    require(
        M >= need,
        f"zbh2 needs {_KNOB_M} >= 2*pipeline.degree-1 = {need} for its warm-up of 2P-1 forwards "
        f"(got {M}): set {_KNOB_M} to at least {need}, or use zbh1",
    )


def check_zbv(P: int, M: int, v: int = 2) -> None:
    """Any M >= 1. torch's ScheduleZBVZeroBubble sets no bound on M either: it builds
    the schedule for max(M, 2P-1) microbatches and drops the extra ones, as `zbv` does."""
    check_basic("zbv", P, M)
    require(v == 2, f"zbv runs exactly 2 stages per rank (V placement), got {v}")


# ---------------------------------------------------------------- analytic bubble
def zbh1_bubble(P: int, v: int, c: RankCosts) -> float:
    """Idle ms of every rank: (P-1)(F+B-W), paper Section 3.1, when W <= min(F, B)
    (the paper's regime, T_W < T_F < T_B). A W longer than F or B cannot hide the
    warm-up / B-chain gaps, and the idle becomes (P-1) max(F, B); the max() makes
    the formula exact for every cost in our simulator when M >= P and comm is 0."""
    return (P - 1) * max(c.F + c.B - c.W, c.F, c.B)


SPECS: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(
        name="zbh1",
        placement_kind="loop",
        generate=zbh1,
        check=check_zbh1,
        description=(
            "ZB-H1 (Qi et al. 2024): 1F1B's warm-up with split backward, rank r deferring r W passes "
            "into the tail, bubble (P-1)(F+B-W) at 1F1B's activation memory."
        ),
        fixed_stages_per_rank=1,
        analytic_bubble=zbh1_bubble,
    ),
    ScheduleSpec(
        name="zbh2",
        placement_kind="loop",
        generate=zbh2,
        check=check_zbh2,
        description=(
            "ZB-H2 (Qi et al. 2024): 2(P-r)-1 warm-up forwards and 2r deferred W passes on rank r, "
            "trading about 2P-1 live activation sets for a smaller bubble than ZB-H1."
        ),
        fixed_stages_per_rank=1,
        analytic_bubble=None,  # see module docstring: the paper's (P-1)(F+B-2W) needs post-validation
    ),
    ScheduleSpec(
        name="zbv",
        placement_kind="v",
        generate=zbv,
        check=check_zbv,
        description=(
            "ZB-V (Qi et al. 2024, Section 6): two half-size stages per rank in a V, split backward, "
            "near-zero bubble at 1F1B's activation memory."
        ),
        fixed_stages_per_rank=2,
        analytic_bubble=None,
    ),
)
