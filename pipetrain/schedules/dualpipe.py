"""DualPipe and DualPipe-V (DeepSeek-V3 technical report, arXiv:2412.19437, and
github.com/deepseek-ai/DualPipe, dualpipe/dualpipe.py and dualpipe/dualpipev.py).

Both schedules give every rank two stages, which the reference calls *phase 0*
and *phase 1*, and run the same eight steps on every rank; only the step counts
depend on the rank:

  1 nF0        warm-up forwards of phase 0
  2 nF0F1      forwards alternating between the phases
  3 nB1W1F1    zero bubble: input-grad B of phase 1, one deferred W, forward of phase 1
  4 nF0B1F1B0  main step: overlapped F&B pairs, F0&BW1 then F1&BW0
  5 nB1F1B0    full backward of phase 1, then F1&BW0
  6 nB1B0      backwards of both phases; the second half defer their W (zero bubble)
  7 nWB0       one deferred W, then B of phase 0 (its W deferred)
  8 nW         drain the deferred Ws

Deferred weight grads run first-in first-out (the reference's WeightGradStore is a
FIFO queue), so every `B` gets its `W` from the oldest pending one.

DualPipe (placement "mirror"): microbatches 0..M/2-1 enter at rank 0 (chain 0),
M/2..M-1 at rank P-1 (chain 1). For a rank in the first half, phase 0 is its chain-0
stage r; in the second half phase 0 is its chain-1 stage 2P-1-r, so phase 0 is always
the direction whose entry is nearer (reference: `phase ^= self.is_in_second_half`).
Step counts use the *half rank* min(r, P-1-r), P/2 half ranks and M/2 microbatches per
direction: the two halves of the pipeline run mirror images of one schedule.

DualPipe-V (placement "v", Sea AI Lab's "cut-in-half" of DualPipe): one chain 0..2P-1,
rank r holds stage r (phase 0) and 2P-1-r (phase 1). It is exactly the first half of
DualPipe on 2P ranks with the mirror rank folded onto the same device: half rank r,
P half ranks, M microbatches per phase.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from pipetrain.schedules.ir import Action, Op, Overlap, Step
from pipetrain.schedules.spec import RankCosts, ScheduleSpec, check_basic, require


@dataclass
class _Rank:
    """One rank's step list under construction, with the reference's per-phase counters."""

    stage: tuple[int, int]  # phase -> stage id
    microbatches: tuple[Sequence[int], Sequence[int]]  # phase -> microbatches in flow order
    steps: list[Step] = field(default_factory=list)
    _next_f: list[int] = field(default_factory=lambda: [0, 0])
    _next_b: list[int] = field(default_factory=lambda: [0, 0])
    _pending_w: deque[Action] = field(default_factory=deque)

    def _forward(self, phase: int) -> Action:
        mb = self.microbatches[phase][self._next_f[phase]]
        self._next_f[phase] += 1
        return Action(Op.F, self.stage[phase], mb)

    def _backward(self, phase: int, split: bool) -> Action:
        # split=True is the reference's enable_zb: keep only the input grad now (B) and
        # queue the weight grad (W) for a later _weight_chunk; otherwise a full BW.
        mb = self.microbatches[phase][self._next_b[phase]]
        self._next_b[phase] += 1
        if split:
            self._pending_w.append(Action(Op.W, self.stage[phase], mb))
            return Action(Op.B, self.stage[phase], mb)
        return Action(Op.BW, self.stage[phase], mb)

    def f(self, phase: int) -> None:
        self.steps.append(self._forward(phase))

    def b(self, phase: int, *, split: bool = False) -> None:
        self.steps.append(self._backward(phase, split))

    def w(self) -> None:
        self.steps.append(self._pending_w.popleft())

    def fb(self, f_phase: int, b_phase: int) -> None:
        # The overlapped pair always runs a full backward (the reference's
        # _forward_backward_chunk never enables zero bubble).
        self.steps.append(Overlap(self._forward(f_phase), self._backward(b_phase, split=False)))

    def finish(self) -> list[Step]:
        assert not self._pending_w, f"deferred W left over: {list(self._pending_w)}"
        return self.steps


def _eight_steps(rank: _Rank, *, half_rank: int, half_ranks: int, per_phase: int) -> list[Step]:
    """The reference's step() for one rank, with sends/receives left to the executor.

    `half_rank` is the rank's distance from its pipeline end, `half_ranks` how many
    such distances there are (P/2 for DualPipe, P for DualPipe-V), `per_phase` how
    many microbatches pass through each of the rank's two stages.
    """
    h, n = half_rank, half_ranks
    is_middle = h == n - 1  # the ranks where the two directions meet
    for _ in range(2 * (n - h - 1)):  # step 1
        rank.f(0)
    for _ in range(h + 1):  # step 2
        rank.f(0)
        rank.f(1)
    for _ in range(n - h - 1):  # step 3
        rank.b(1, split=True)
        rank.w()
        rank.f(1)
    for i in range(per_phase - 2 * n + h + 1):  # step 4
        if i == 0 and is_middle:
            # Reference: "We don't overlap these two chunks to further reduce bubble
            # size". Split, the F0 result leaves (to the other middle rank, or to this
            # rank's own F1 in DualPipe-V) before the BW1 ends. In our simulator that
            # shortens the step when comm_ms > 0 and fb_overlap = 0, but gives up one
            # pair's overlap saving, which can cost more when fb_overlap is large.
            rank.f(0)
            rank.b(1)
        else:
            rank.fb(0, 1)
        rank.fb(1, 0)
    for _ in range(n - h - 1):  # step 5
        rank.b(1)
        rank.fb(1, 0)
    split = False
    for i in range(h + 1):  # step 6: from the middle on, B defers its W
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        rank.b(1, split=split)
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        rank.b(0, split=split)
    for _ in range(n - h - 1):  # step 7
        rank.w()
        rank.b(0, split=True)
    for _ in range(h + 1):  # step 8
        rank.w()
    return rank.finish()


def generate_dualpipe(P: int, M: int, v: int = 2) -> list[list[Step]]:
    """Per-rank steps of DualPipe on the mirror placement (v is fixed at 2)."""
    half = M // 2
    chain0, chain1 = range(0, half), range(half, M)
    out = []
    for r in range(P):
        near, far = (r, 2 * P - 1 - r), (chain0, chain1)
        if r >= P // 2:  # second half: the chain-1 stage is the one nearer its entry
            near, far = (2 * P - 1 - r, r), (chain1, chain0)
        rank = _Rank(stage=near, microbatches=far)
        out.append(_eight_steps(rank, half_rank=min(r, P - 1 - r), half_ranks=P // 2, per_phase=half))
    return out


def generate_dualpipev(P: int, M: int, v: int = 2) -> list[list[Step]]:
    """Per-rank steps of DualPipe-V on the V placement (v is fixed at 2)."""
    mbs = range(M)  # every microbatch passes both legs of the V
    out = []
    for r in range(P):
        rank = _Rank(stage=(r, 2 * P - 1 - r), microbatches=(mbs, mbs))
        out.append(_eight_steps(rank, half_rank=r, half_ranks=P, per_phase=M))
    return out


def check_dualpipe(P: int, M: int, v: int = 2) -> None:
    check_basic("dualpipe", P, M)
    # dualpipe.py asserts num_ranks % 2 == 0: the two directions meet between the two middle ranks.
    require(
        P % 2 == 0, f"dualpipe needs an even pipeline.degree (got {P}): set pipeline.degree to 2, 4, ..."
    )
    # dualpipe.py asserts num_chunks % 2 == 0 and num_chunks >= num_ranks * 2: half the
    # microbatches go each way, and the warm-up of each direction (steps 1-3) holds up to
    # P - 1 of them. (The step counts stay non-negative down to M = 2P - 2; we keep the
    # reference's bound, the one its bubble and memory figures are stated for.)
    require(
        M % 2 == 0,
        f"dualpipe splits pipeline.microbatches evenly between its two directions (got {M}): "
        "set pipeline.microbatches to an even number",
    )
    require(
        M >= 2 * P,
        f"dualpipe needs pipeline.microbatches >= 2 * pipeline.degree = {2 * P} (got {M}): "
        f"set pipeline.microbatches to at least {2 * P}",
    )


def check_dualpipev(P: int, M: int, v: int = 2) -> None:
    check_basic("dualpipev", P, M)
    # dualpipev.py asserts num_chunks >= num_ranks * 2 (torch's ScheduleDualPipeV: at least
    # as many microbatches as stages). Step 4's count M - 2P + r + 1 goes negative on rank 0
    # below M = 2P - 1; as for DualPipe we keep the reference's bound. Any M works (no parity).
    require(
        M >= 2 * P,
        f"dualpipev needs pipeline.microbatches >= 2 * pipeline.degree = {2 * P} (got {M}): "
        f"set pipeline.microbatches to at least {2 * P}",
    )


def dualpipe_bubble(P: int, v: int, c: RankCosts) -> float:
    """DualPipe README: (PP/2 - 1)(F&B + B - 3W), B there meaning a full backward (our BW).

    A mirror stage is a whole rank share, so the README's chunk costs are RankCosts as is.
    """
    return (P / 2 - 1) * (c.FB + c.BW - 3 * c.W)


def dualpipev_bubble(P: int, v: int, c: RankCosts) -> float:
    """DualPipe-V is DualPipe on PP = 2P stages whose chunks are half a rank share:
    (2P/2 - 1)(F&B + B - 3W) / 2 = (P - 1)(F&B + BW - 3W) / 2 in rank-share costs."""
    return (P - 1) * (c.FB + c.BW - 3 * c.W) / 2


SPECS: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(
        name="dualpipe",
        placement_kind="mirror",
        generate=generate_dualpipe,
        check=check_dualpipe,
        description="DeepSeek's bidirectional DualPipe: half the microbatches enter at each end "
        "of a mirrored pipeline and overlapped F&B pairs fill the middle.",
        fixed_stages_per_rank=2,
        analytic_bubble=dualpipe_bubble,
    ),
    ScheduleSpec(
        name="dualpipev",
        placement_kind="v",
        generate=generate_dualpipev,
        check=check_dualpipev,
        description="DualPipe cut in half onto a V placement: one copy of the weights, "
        "2 stages per rank, overlapped F&B pairs in the steady state.",
        fixed_stages_per_rank=2,
        analytic_bubble=dualpipev_bubble,
    ),
)
