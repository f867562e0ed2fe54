"""Schedule names -> specs, and the one way to get a Schedule from a name or a file.

Pure Python, no torch.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.placement import PLACEMENT_KINDS, Placement
from pipetrain.schedules.spec import RankCosts, ScheduleSpec

CUSTOM = "custom"


@cache
def schedules() -> dict[str, ScheduleSpec]:
    """All built-in schedules by name, in the order users see them."""
    from pipetrain.schedules import dualpipe, loop, zb_auto, zero_bubble

    specs = (*loop.SPECS, *zero_bubble.SPECS, *zb_auto.SPECS, *dualpipe.SPECS)
    return {s.name: s for s in specs}


def names() -> list[str]:
    return list(schedules())


def get(name: str) -> ScheduleSpec:
    table = schedules()
    if name not in table:
        raise ValueError(
            f"unknown schedule {name!r}: choose schedule= one of {', '.join([*table, CUSTOM])}"
        )
    return table[name]


def check(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise the schedule's own one-line ValueError if (P, M, v) is not valid for it."""
    spec = get(name)
    fixed = spec.fixed_stages_per_rank
    if fixed is not None and virtual_stages != fixed:
        raise ValueError(
            f"schedule {name} always places {fixed} stage(s) per rank: "
            f"set schedule.virtual_stages={fixed} (got {virtual_stages})"
        )
    if fixed is None and virtual_stages < 1:
        raise ValueError(f"schedule.virtual_stages must be >= 1 (got {virtual_stages})")
    spec.check(num_ranks, num_microbatches, spec.stages_per_rank(virtual_stages))


def build(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Generate a built-in schedule after checking its constraints."""
    check(name, num_ranks, num_microbatches, virtual_stages)
    return get(name).build(num_ranks, num_microbatches, virtual_stages)


def placement_for(
    name: str, num_ranks: int, virtual_stages: int = 1, *, custom_placement: str = "loop"
) -> Placement:
    """The placement a schedule name (or a custom file's declared kind) puts on P ranks."""
    if name == CUSTOM:
        if custom_placement not in PLACEMENT_KINDS:
            raise ValueError(
                f"schedule.placement={custom_placement!r} is unknown: choose one of {', '.join(PLACEMENT_KINDS)}"
            )
        return Placement(custom_placement, num_ranks, virtual_stages if custom_placement == "loop" else 2)
    return get(name).placement(num_ranks, virtual_stages)


def load_custom(
    path: str | Path,
    *,
    num_ranks: int,
    num_microbatches: int,
    placement: str = "loop",
    virtual_stages: int = 1,
) -> Schedule:
    """Read a hand-written schedule: CSV (one row per rank) or text (`rank R: 0F0 ...`).

    The caller validates it like any generated schedule.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"schedule.path={path} is a directory: point it at a .csv or .txt schedule file in it")
    if not path.is_file():
        raise FileNotFoundError(f"schedule.path={path} does not exist: point it at a .csv or .txt schedule file")
    text = path.read_text(encoding="utf-8-sig")  # -sig: Excel's CSVs start with a byte-order mark
    rows = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not rows:
        raise ValueError(f"schedule.path={path} holds no schedule (no rows besides comments): write one row of "
                         f"actions per rank, e.g. 0F0,0F1,0BW0,0BW1 (mode=simulate writes schedule.csv to start from)")
    if len(rows) != num_ranks:
        raise ValueError(
            f"{path.name} lists {len(rows)} ranks but pipeline.degree={num_ranks}: "
            f"set pipeline.degree={len(rows)} or edit the file"
        )
    pl = placement_for(CUSTOM, num_ranks, virtual_stages, custom_placement=placement)
    as_text = all(ln.strip().startswith("rank") for ln in rows)
    reader = Schedule.from_text if as_text else Schedule.from_csv
    try:
        schedule = reader(text, name=CUSTOM, placement=pl, num_microbatches=num_microbatches)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    used = 1 + max((a.microbatch for r in range(num_ranks) for a in schedule.actions(r)), default=-1)
    if used != num_microbatches:
        raise ValueError(
            f"{path.name} schedules {used} microbatches but pipeline.microbatches={num_microbatches}: "
            f"set pipeline.microbatches={used}"
        )
    return schedule


def rank_costs(schedule: Schedule, stage_f: list[float], stage_b: list[float], stage_w: list[float],
               fb_overlap: float = 0.0) -> RankCosts:
    """F, B, W of one microbatch through the heaviest rank's share of the model.

    A rank's share is the sum over the stages it holds divided by the parameter copies
    (DualPipe's rank holds two mirrored stages but only 1/P of one model's work per microbatch).
    """
    pl = schedule.placement
    best = (0.0, 0.0, 0.0)
    for r in range(pl.num_ranks):
        share = tuple(
            sum(c[s] for s in pl.stages_of(r)) / pl.param_copies for c in (stage_f, stage_b, stage_w)
        )
        if sum(share) > sum(best):
            best = share
    F, B, W = best
    return RankCosts(F=F, B=B, W=W, FB=(F + B + W) * (1.0 - fb_overlap))
