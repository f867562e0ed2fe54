"""Loop-placement schedules: GPipe, 1F1B, interleaved 1F1B and looped BFS.

All four use the loop placement (stage s on rank s % P, one chain 0..vP-1) and
the full backward `BW` (no B/W split). Each generator is a function of integers
returning, for every rank, its ordered steps; the validator and the simulator
decide whether that order is deadlock-free and how long it takes.

Notation: P ranks (pipeline.degree), M microbatches per optimizer step
(pipeline.microbatches), v stages per rank (1, or schedule.virtual_stages).
A rank's local stage c (0 <= c < v) is the global stage c * P + r.

Analytic bubbles are the idle time of *every* rank, in the costs of one
microbatch through one rank's whole share of the model (`RankCosts`); with v
stages per rank one stage costs 1/v of that. Each formula below is exact (the
simulator agrees to 1e-9 on every rank, tests/test_schedules_loop.py) for
uniform stage costs, zero communication time, and every M its check accepts.

Pure Python, no torch.
"""

from __future__ import annotations

from pipetrain.schedules.ir import Action, Op, Step
from pipetrain.schedules.spec import RankCosts, ScheduleSpec, check_basic, require

Steps = list[list[Step]]


def _f(stage: int, mb: int) -> Action:
    return Action(Op.F, stage, mb)


def _bw(stage: int, mb: int) -> Action:
    return Action(Op.BW, stage, mb)


# ---- GPipe ------------------------------------------------------------------------------


def gpipe(P: int, M: int, v: int = 1) -> Steps:
    """GPipe (Huang et al. 2019, fill-drain): every rank runs all M forwards, then all M backwards.

    Backwards go in forward microbatch order 0..M-1, as torch's ScheduleGPipe
    (`_get_pipeline_order`, "Backward passes for all microbatches": `for mb_idx in
    range(n_microbatches)`). The order changes neither the bubble nor the peak (all M
    activation sets are live when the first backward starts either way), and matching
    torch keeps our traces comparable with torch.distributed.pipelining's.
    """
    assert v == 1, "gpipe holds one stage per rank"
    return [[_f(r, m) for m in range(M)] + [_bw(r, m) for m in range(M)] for r in range(P)]


# ---- 1F1B (PipeDream-flush / Megatron non-interleaved) ---------------------------------


def one_f_one_b(P: int, M: int, v: int = 1) -> Steps:
    """1F1B (Narayanan et al. 2021, PipeDream-Flush), in warm-up / steady / cool-down phases.

    Rank r first runs P-1-r forwards (capped at M) so that the first backward can
    come back before it runs out of work, then alternates one forward with one backward,
    then drains the backwards it still owes. Counts as Megatron-LM's
    forward_backward_pipelining_without_interleaving:
    `num_warmup_microbatches = min(total_stages - current_stage - 1, num_microbatches)`.
    At most P-r activation sets are live on rank r (warm-up + the steady forward).
    """
    assert v == 1, "1f1b holds one stage per rank"
    out: Steps = []
    for r in range(P):
        warmup = min(P - 1 - r, M)
        steady = M - warmup  # each steady iteration: F(warmup + i) then BW(i)
        steps: list[Step] = [_f(r, m) for m in range(warmup)]
        for i in range(steady):
            steps += [_f(r, warmup + i), _bw(r, i)]
        steps += [_bw(r, m) for m in range(steady, M)]  # cool-down: `warmup` backwards
        out.append(steps)
    return out


# ---- Interleaved 1F1B (Megatron-LM virtual pipeline) ------------------------------------


def _interleaved_unit(k: int, P: int, v: int, *, forward: bool) -> tuple[int, int]:
    """(local stage c, microbatch) of a rank's k-th forward (or k-th backward).

    Megatron's classic table: microbatches go in groups of P; within a group of P*v
    "virtual microbatches" a rank runs the group through local stage 0, then 1, ...
    (get_model_chunk_id: `(k % (P*v)) // P`, reversed for backward;
    get_microbatch_id_in_model_chunk: `(k // (P*v)) * P + k % P`).
    """
    chunk = (k % (P * v)) // P
    mb = (k // (P * v)) * P + k % P
    return (chunk if forward else v - 1 - chunk), mb


def interleaved_warmup(P: int, M: int, v: int, rank: int) -> int:
    """Forwards rank `rank` runs before its first backward (Megatron-LM get_pp_rank_microbatches).

    `(P - rank - 1) * 2 + (v - 1) * P`, capped at v*M: the last rank must first push a
    whole group of P microbatches through its v-1 lower stages, and each hop further from
    it adds one forward going down plus one backward coming back. (With comm_ms = 0 one
    per hop would do, but the second is the slack that hides P2P latency: at comm_ms = 0.5
    of F=1, P=8, v=3, M=32 it cuts the simulated makespan from 401 to 332.) Megatron before
    commit 4295be1a6c (2024-11) also ran *all* forwards first when M == P; the current
    code (default microbatch_group_size_per_vp_stage = P) does not, and neither do we:
    the simulated bubble is the same and later ranks hold fewer activation sets.
    """
    return min((P - rank - 1) * 2 + (v - 1) * P, v * M)


def interleaved_1f1b(P: int, M: int, v: int) -> Steps:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2), the order of Megatron-LM's
    forward_backward_pipelining_with_interleaving with microbatch groups of P.

    Warm-up forwards, then steady iterations of "forward k + warmup, backward k", then the
    backwards still owed; the k-th forward / backward of a rank is `_interleaved_unit(k)`.
    """
    assert M % P == 0, "check_interleaved guarantees whole groups of P microbatches"
    out: Steps = []
    for r in range(P):
        total = v * M  # forwards (= backwards) this rank runs: M microbatches x v stages

        def fwd(k: int, r: int = r) -> Action:  # r bound at definition: this rank, whenever it is called
            c, m = _interleaved_unit(k, P, v, forward=True)
            return _f(c * P + r, m)

        def bwd(k: int, r: int = r) -> Action:
            c, m = _interleaved_unit(k, P, v, forward=False)
            return _bw(c * P + r, m)

        warmup = interleaved_warmup(P, M, v, r)
        steady = total - warmup
        steps: list[Step] = [fwd(k) for k in range(warmup)]
        for k in range(steady):
            steps += [fwd(warmup + k), bwd(k)]
        steps += [bwd(k) for k in range(steady, total)]
        out.append(steps)
    return out


# ---- Looped BFS ---------------------------------------------------------------------------


def looped_bfs(P: int, M: int, v: int) -> Steps:
    """Breadth-first looped schedule (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism").

    Each rank runs every microbatch through its lowest stage, then through its next
    stage, ...; then the backwards, highest stage first, microbatches in reverse (the
    last forward is the first backward), as torch's ScheduleLoopedBFS.
    """
    out: Steps = []
    for r in range(P):
        stages = [c * P + r for c in range(v)]
        steps: list[Step] = [_f(s, m) for s in stages for m in range(M)]
        steps += [_bw(s, m) for s in reversed(stages) for m in reversed(range(M))]
        out.append(steps)
    return out


# ---- constraints --------------------------------------------------------------------------


def _check_single(name: str, P: int, M: int, v: int) -> None:
    check_basic(name, P, M)
    require(
        v == 1,
        f"{name} holds one stage per rank (got {v}): "
        "use interleaved_1f1b or looped_bfs for schedule.virtual_stages > 1",
    )


def check_gpipe(P: int, M: int, v: int = 1) -> None:
    _check_single("gpipe", P, M, v)


def check_1f1b(P: int, M: int, v: int = 1) -> None:
    _check_single("1f1b", P, M, v)


def _check_virtual(name: str, v: int, minimum: int) -> None:
    require(
        v >= minimum,
        f"{name} needs schedule.virtual_stages >= {minimum} (got {v}): "
        f"set schedule.virtual_stages to {minimum} or more"
        + (" (or use 1f1b for one stage per rank)" if minimum == 2 else ""),
    )


def check_interleaved(P: int, M: int, v: int) -> None:
    """The order walks microbatches in groups of P, so M must be a multiple of P: Megatron-LM
    raised "number of microbatches is not divisible by pipeline-model-parallel-size when
    using interleaved schedule" until 2024-11, and still rejects a last group of 0 < M % N < P
    microbatches ("dependency bubbles"), which with the default group size N = P is the same rule."""
    check_basic("interleaved_1f1b", P, M)
    _check_virtual("interleaved_1f1b", v, 2)
    require(
        M % P == 0,
        f"interleaved_1f1b needs pipeline.microbatches to be a multiple of pipeline.degree={P} (got {M}): "
        f"set pipeline.microbatches to {P}, {2 * P}, {3 * P}, ...",
    )


def check_looped_bfs(P: int, M: int, v: int) -> None:
    """Any M is deadlock-free, but with v > 1 and M < P a rank finishes its M forwards of
    one stage before microbatch 0 has come round the loop to its next stage, and idles
    (P - M) stage-forwards per loop (the same again in the backward): (v-1)(P-M)(f+b)
    beyond the published bubble, which therefore is exact only for M >= P.
    """
    check_basic("looped_bfs", P, M)
    _check_virtual("looped_bfs", v, 1)
    require(
        v == 1 or M >= P,
        f"looped_bfs with schedule.virtual_stages={v} needs pipeline.microbatches >= pipeline.degree={P} "
        f"(got {M}), or ranks stall between their stages: set pipeline.microbatches to {P} or more "
        "(or schedule.virtual_stages to 1)",
    )


# ---- analytic bubbles (idle ms of every rank) ---------------------------------------------


def bubble_fill_drain(P: int, v: int, c: RankCosts) -> float:
    """GPipe and 1F1B: (P-1)(F+BW) -- P-1 forward slots to fill, P-1 backward slots to drain."""
    return (P - 1) * (c.F + c.BW)


def bubble_looped(P: int, v: int, c: RankCosts) -> float:
    """Interleaved 1F1B and looped BFS: the same P-1 fill/drain slots, each a stage of 1/v
    of a rank's share (Narayanan et al. 2021, eq. (2): bubble (p-1)/v (t_f + t_b))."""
    return (P - 1) * (c.F + c.BW) / v


SPECS: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(
        name="gpipe",
        placement_kind="loop",
        generate=gpipe,
        check=check_gpipe,
        description="GPipe fill-drain: every rank runs all forwards, then all backwards (peak M).",
        fixed_stages_per_rank=1,
        analytic_bubble=bubble_fill_drain,
    ),
    ScheduleSpec(
        name="1f1b",
        placement_kind="loop",
        generate=one_f_one_b,
        check=check_1f1b,
        description="1F1B (PipeDream-flush): P-1-r warm-up forwards, then alternate F and BW, then drain.",
        fixed_stages_per_rank=1,
        analytic_bubble=bubble_fill_drain,
    ),
    ScheduleSpec(
        name="interleaved_1f1b",
        placement_kind="loop",
        generate=interleaved_1f1b,
        check=check_interleaved,
        description="Megatron interleaved 1F1B: v stages per rank, microbatches in groups of P, depth first.",
        fixed_stages_per_rank=None,
        analytic_bubble=bubble_looped,
    ),
    ScheduleSpec(
        name="looped_bfs",
        placement_kind="loop",
        generate=looped_bfs,
        check=check_looped_bfs,
        description="Breadth-first looping: a rank runs all microbatches through one stage, then its next.",
        fixed_stages_per_rank=None,
        analytic_bubble=bubble_looped,
    ),
)
