"""Show a simulated schedule: a per-rank timeline in the terminal, a summary table,
the JSON record written to simulate.json, and a Chrome trace (Perfetto).

The timeline draws time left to right, one row per rank, the way the pipeline
papers draw their schedules (GPipe Fig. 2, zero-bubble Fig. 3, DualPipe's README):
each step is a coloured block with its microbatch inside where it fits, idle time
is dim dots. Under data parallel each rank's communication lane is a row of its own under
the rank ("dp"), each gradient reduction a block `R{stage}`. A long schedule wraps into bands
(windows of time, all ranks each) instead of dropping steps. Pure Python + rich, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich import box
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from pipetrain.schedules.export import ChromeTrace, rounded
from pipetrain.schedules.ir import Action, Overlap, Step
from pipetrain.schedules.simulate import ReduceSpan, SimResult, TimedStep, live_activations

# op -> (style on a rank's 1st/3rd.. stage, style on its 2nd/4th.. stage). The later
# stage is bold on a darker shade so a V or mirror rank's two legs read apart.
STYLES: dict[str, tuple[str, str]] = {
    "F": ("white on blue", "bold bright_white on dark_blue"),
    "B": ("black on green3", "bold bright_white on dark_green"),
    "W": ("black on orange1", "bold black on dark_orange3"),
    "BW": ("black on dark_cyan", "bold bright_white on turquoise4"),
    "F&B": ("white on magenta3", "bold bright_white on dark_magenta"),
}
# One character per op for blocks too narrow for a microbatch number (plain-text readable).
GLYPHS: dict[str, str] = {"F": "F", "B": "B", "W": "W", "BW": "X", "F&B": "&"}
IDLE_CHAR, IDLE_STYLE = "·", "dim"
REDUCE_STYLES = ("white on purple4", "bold bright_white on dark_violet")  # a rank's 1st / later stage
LANE_LABEL = "dp"
MAX_BANDS = 12
# Rows (ranks and dp lanes) x bands drawn at most: fewer bands past 256 rows x 12 (at P=10^4, 12 bands were
# 120,000 lines and a sixth of mode=simulate's time); a schedule that tall gets one band, time compressed.
MAX_LINES = 256 * MAX_BANDS


def op_name(step: Step) -> str:
    """The op of a step as the legend names it: F, B, W, BW, or F&B for an overlapped pair."""
    return "F&B" if isinstance(step, Overlap) else step.op.value


def _local_stage(result: SimResult, rank: int, step: Step) -> int:
    """Index of the step's stage among the rank's stages (an F&B pair: its forward's)."""
    stage = step.forward.stage if isinstance(step, Overlap) else step.stage
    return result.schedule.placement.stages_of(rank).index(stage)


# ---- timeline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    c0: int  # first column (inclusive)
    c1: int  # last column (exclusive)
    timed: TimedStep | ReduceSpan
    later_stage: bool  # odd local stage index: drawn bold / lowercase


def _choose_scale(result: SimResult, avail: int, max_bands: int) -> float:
    """Columns per ms. Prefer the shortest step wide enough for "F12" (op + microbatch),
    then for "12", then 1 column, as long as it fits in `max_bands` bands; else compress."""
    durs = [ts.end - ts.start for row in result.timeline for ts in row if ts.end > ts.start]
    span = result.makespan_with_reduce  # the timeline runs until the last reduction is done
    if not durs or span <= 0:
        return 1.0
    unit, digits = min(durs), len(str(max(result.schedule.num_microbatches - 1, 0)))
    budget = avail * max_bands
    for target in (digits + 1, digits, 1):
        cols = math.ceil(span * target / unit)
        if cols <= budget:
            # Small schedules: stretch by a whole factor (<= 3) if it still fits on one line.
            stretch = max(1, min(3, avail // max(cols, 1))) if target == digits + 1 else 1
            return target * stretch / unit
    return budget / span


def _snap(spans: Sequence[tuple[float, float]], scale: float, ncols: int) -> tuple[list[tuple[int, int, int]], int]:
    """Snap one row's consecutive spans (ms) to columns: (index, c0, c1) with [round(start*scale),
    round(end*scale)). A span that rounds to zero width takes one column if that column is free,
    else it is not drawn (counted). Adjacent spans share boundaries, so blocks never overlap or drift."""
    out, dropped, last = [], 0, 0
    for i, (start, end) in enumerate(spans):
        c0 = max(round(start * scale), last)
        c1 = min(round(end * scale), ncols)
        if c1 <= c0:
            c0 = min(c0, ncols - 1)  # a step ending the makespan still gets the last column
            nxt = round(spans[i + 1][0] * scale) if i + 1 < len(spans) else ncols
            if c0 < last or c0 >= min(nxt, ncols):
                dropped += 1
                continue
            c1 = c0 + 1
        out.append((i, c0, c1))
        last = c1
    return out, dropped


def _blocks(result: SimResult, rank: int, scale: float, ncols: int) -> tuple[list[_Block], int]:
    """A rank's steps as blocks of columns (see `_snap`)."""
    row = result.timeline[rank]
    snapped, dropped = _snap([(ts.start, ts.end) for ts in row], scale, ncols)
    return [_Block(c0, c1, row[i], _local_stage(result, rank, row[i].step) % 2 == 1) for i, c0, c1 in snapped], dropped


def _lane_blocks(result: SimResult, rank: int, scale: float, ncols: int) -> list[_Block]:
    """A rank's gradient reductions as blocks of columns (its communication lane)."""
    lane = result.reductions[rank]
    stages = result.schedule.placement.stages_of(rank)
    snapped, _ = _snap([(sp.start, sp.end) for sp in lane], scale, ncols)
    return [_Block(c0, c1, lane[i], stages.index(lane[i].stage) % 2 == 1) for i, c0, c1 in snapped]


def _label(step: Step, width: int, later: bool, *, continued: bool = False, plain: bool = False) -> str:
    """Most informative label that fits: "F3" (op + microbatch), "3" (colour tells the op), else
    the op glyph. Ops on a rank's later stage are lower case so plain text shows the leg too. The
    part of a block continued from the previous band repeats only a full label. `plain` (no
    colour: piped, NO_COLOR) skips the bare number, which would run into its neighbours ("b2929")."""
    if isinstance(step, Overlap):
        f, b = step.forward.microbatch, step.backward.microbatch
        choices = [f"{f}&{b}", f"{f}", GLYPHS["F&B"]]
    else:
        op = step.op.value.lower() if later else step.op.value
        glyph = GLYPHS[step.op.value]
        choices = [f"{op}{step.microbatch}", f"{step.microbatch}", glyph.lower() if later else glyph]
    if plain:
        choices = [choices[0], choices[-1]]
    for text in choices[:1] if continued else choices:
        if len(text) <= width:
            return text.ljust(width)
    return " " * width if continued else choices[-1][:width]


def _reduce_label(stage: int, width: int, *, continued: bool = False) -> str:
    """"R3" (stage 3's gradient reduction) where it fits, else "R"."""
    for text in ([f"R{stage}"] if continued else [f"R{stage}", "R"]):
        if len(text) <= width:
            return text.ljust(width)
    return " " * width


def _ruler(b0: int, b1: int, scale: float, label_w: int) -> Text:
    """Tick labels in ms at 'nice' times (1, 2, 5 x 10^k) at least ~8 columns apart."""
    line = [" "] * (b1 - b0)
    raw = 8 / scale
    tick = min(m * 10**e for e in range(math.floor(math.log10(raw)), math.floor(math.log10(raw)) + 2)
               for m in (1, 2, 5) if m * 10**e >= raw)
    t = math.ceil(b0 / scale / tick) * tick
    while round(t * scale) < b1:
        text, pos = f"{t:g}", round(t * scale) - b0
        if pos + len(text) <= len(line) and all(c == " " for c in line[max(0, pos - 1):pos + len(text)]):
            line[pos:pos + len(text)] = text
        t += tick
    return Text("t (ms)".rjust(label_w - 2) + " ╷" + "".join(line), style="dim", no_wrap=True)


def _band_row(blocks: Sequence[_Block], b0: int, b1: int, plain: bool = False) -> Text:
    text, col = Text(no_wrap=True), b0
    for blk in blocks:
        if blk.c1 <= b0 or blk.c0 >= b1:
            continue
        c0, c1 = max(blk.c0, b0), min(blk.c1, b1)
        if c0 > col:
            text.append(IDLE_CHAR * (c0 - col), style=IDLE_STYLE)
        if isinstance(blk.timed, ReduceSpan):
            label = _reduce_label(blk.timed.stage, c1 - c0, continued=blk.c0 < b0)
            text.append(label, style=REDUCE_STYLES[blk.later_stage])
        else:
            step = blk.timed.step
            label = _label(step, c1 - c0, blk.later_stage, continued=blk.c0 < b0, plain=plain)
            text.append(label, style=STYLES[op_name(step)][blk.later_stage])
        col = c1
    if b1 > col:
        text.append(IDLE_CHAR * (b1 - col), style=IDLE_STYLE)
    return text


def _legend(result: SimResult, scale: float, bands: int, dropped: int) -> list[Text]:
    sched = result.schedule
    present = {op_name(ts.step) for row in result.timeline for ts in row}
    legend = Text("legend: ", no_wrap=False)
    for op, (style, _) in STYLES.items():
        if op in present:
            legend.append(f" {op} ", style=style)
            legend.append(" ")
    if result.reductions:
        legend.append(" R ", style=REDUCE_STYLES[0])
        legend.append(" reduction (dp row)  ")
    legend.append(f"{IDLE_CHAR * 3} idle", style=IDLE_STYLE)
    glyphs = [f"{GLYPHS[op]} = {op}" for op in ("BW", "F&B") if op in present]
    if glyphs:
        legend.append(f"   narrow blocks: {', '.join(glyphs)}")
    v = sched.placement.stages_per_rank
    lines = [legend]
    if v > 1:
        stages = ", ".join(f"r{r}: {'|'.join(map(str, sched.placement.stages_of(r)))}"
                           for r in range(min(sched.num_ranks, 2)))
        more = ", ..." if sched.num_ranks > 2 else ""
        lines.append(Text(f"{v} stages per rank ({stages}{more}): later ones bold, ops lower case"))
    with_reduce = (f" ({result.makespan_with_reduce:.3f} with reduce)"
                   if result.makespan_with_reduce > result.makespan else "")
    scale_line = (f"1 column = {1 / scale:.4g} ms   makespan {result.makespan:.3f} ms{with_reduce}   "
                  f"{sched.name}: P={sched.num_ranks} v={v} M={sched.num_microbatches}   "
                  f"{bands} band{'s' if bands != 1 else ''}")
    if dropped:
        scale_line += f"   ({dropped} steps narrower than a column not drawn)"
    lines.append(Text(scale_line))
    return lines


def timeline_lines(result: SimResult, width: int, *, max_bands: int = MAX_BANDS, plain: bool = False) -> list[Text]:
    """The timeline as lines of at most `width` cells (see `render_timeline`); `plain`: for output
    without colour (labels that read alone)."""
    P = result.schedule.num_ranks
    label_w = len(f"rank {P - 1} ") + 2  # "rank 7 │"
    avail = max(width - label_w, 8)
    max_bands = max(1, min(max_bands, MAX_LINES // (P * (2 if result.reductions else 1))))
    scale = _choose_scale(result, avail, max_bands)
    ncols = max(1, math.ceil(result.makespan_with_reduce * scale - 1e-9))
    per_rank = [_blocks(result, r, scale, ncols) for r in range(P)]
    lanes = [_lane_blocks(result, r, scale, ncols) for r in range(P)] if result.reductions else []
    nbands = math.ceil(ncols / avail)
    band_w = math.ceil(ncols / nbands)  # equal bands read better than a full one and a stub
    lines: list[Text] = []
    for b in range(nbands):
        b0, b1 = b * band_w, min(ncols, (b + 1) * band_w)
        if nbands > 1:
            lines.append(Text(f"band {b + 1}/{nbands}: {b0 / scale:.4g} .. {b1 / scale:.4g} ms",
                              style="bold"))
        lines.append(_ruler(b0, b1, scale, label_w))
        for r, (blocks, _) in enumerate(per_rank):
            row = Text(f"rank {r}".rjust(label_w - 2) + " │", no_wrap=True)
            lines.append(row + _band_row(blocks, b0, b1, plain))
            if lanes:
                lane = Text(LANE_LABEL.rjust(label_w - 2) + " │", style="dim", no_wrap=True)
                lines.append(lane + _band_row(lanes[r], b0, b1))
    return lines + _legend(result, scale, nbands, sum(d for _, d in per_rank))


class _Timeline:
    """Rich renderable: lays the timeline out at render time for the console's width."""

    def __init__(self, result: SimResult, width: int | None) -> None:
        self.result, self.width = result, width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Each line is at most the width and never wraps: its segments go out as they are. Yielding
        # the Texts would have rich wrap and crop each of P x bands lines (a third of simulate at P=10^4).
        plain = not console.is_terminal or console.no_color
        for line in timeline_lines(self.result, self.width or options.max_width, plain=plain):
            if not line.no_wrap:  # the legend and the scale line may wrap
                yield line
            elif line.spans:
                yield from line.render(console)
                yield Segment.line()
            else:  # render() drops the style of a line without spans
                yield Segment(line.plain, console.get_style(line.style) if line.style else None)
                yield Segment.line()


def render_timeline(result: SimResult, *, width: int | None = None) -> RenderableType:
    """Per-rank timeline of a simulated schedule; print it with a rich Console.

    Ranks are rows, time runs right. F blue, B green, W orange, BW teal, F&B magenta,
    idle dim dots. `width` defaults to the console's width; longer schedules wrap into
    bands (at most 12, fewer where ranks x bands would pass MAX_LINES; beyond that columns
    cover more time and a step shorter than a column may not be drawn, which the scale line says)."""
    return _Timeline(result, width)


# ---- records and tables -------------------------------------------------------------------


def result_record(
    result: SimResult,
    *,
    schedule_name: str,
    analytic_bubble: float | None,
    param_copies: int,
    virtual_stages: int,
) -> dict:
    """The JSON-ready record of one simulation (a row of simulate.json and of `summary_table`);
    with gradient reductions simulated, also the exposed reduce time per rank and the step time
    with it (`makespan_with_reduce`, ms)."""
    sched, busy = result.schedule, result.busy_per_rank
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    fraction = None
    if analytic_bubble is not None and analytic_bubble + mean_busy > 0:
        # the published bubble as a share of a rank's time: idle / (idle + work)
        fraction = rounded(analytic_bubble / (analytic_bubble + mean_busy))
    record = {
        "schedule": schedule_name,
        "degree": sched.num_ranks,
        "stages": sched.placement.num_stages,
        "virtual_stages": virtual_stages,
        "placement": sched.placement.kind,
        "microbatches": sched.num_microbatches,
        "makespan": rounded(result.makespan),
        "busy_per_rank": [rounded(x) for x in busy],
        "idle_per_rank": [rounded(x) for x in result.idle_per_rank],
        "bubble_fraction_per_rank": [rounded(x) for x in result.bubble_fraction_per_rank],
        "bubble_fraction_mean": rounded(result.bubble_fraction_mean),
        "peak_activations_per_rank": list(result.peak_activations_per_rank),
        "param_copies": param_copies,
        "analytic_bubble": None if analytic_bubble is None else rounded(analytic_bubble),
        "analytic_bubble_fraction": fraction,
        "comm_ms": rounded(result.comm_ms),
        "fb_overlap": rounded(result.fb_overlap),
    }
    if result.reductions:
        exposed = result.reduce_exposed_ms
        record.update(reduce_exposed_ms_per_rank=[rounded(x) for x in exposed],
                      reduce_exposed_ms_max=rounded(max(exposed)),
                      makespan_with_reduce=rounded(result.makespan_with_reduce))
    return record


def summary_table(rows: list[dict], *, title: str | None = None,
                  extra: Sequence[tuple[str, str]] = ()) -> Table:
    """One line per `result_record` row: the single-run summary or a multirun comparison (`extra`:
    (row field, header) pairs shown after the schedule, a sweep's other swept knobs). Where a row
    has gradient reductions (data parallel), the step time with the exposed reduce
    takes the analytic bubble's place (the published formulas know no reduction; simulate.json
    keeps both, and the exposed reduce per rank), so the table still fits 80 columns."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    dp = any("makespan_with_reduce" in row for row in rows)
    tail = ("step ms\n+reduce",) if dp else ("analytic\nbubble ms",)
    # Short headers so the table fits an 80-column terminal without truncating values.
    headers = [header for _, header in extra]
    for name in ("schedule", *headers, "P", "v", "M", "makespan\nms", "bubble\nmean %", "bubble\nmax %",
                 "peak\nact", "param\ncopies", *tail):
        table.add_column(name, justify="left" if name == "schedule" or name in headers else "right", no_wrap=True)
    for row in rows:
        fractions = row["bubble_fraction_per_rank"] or [0.0]
        analytic = row.get("analytic_bubble")
        if dp:
            last = f"{row.get('makespan_with_reduce', row['makespan']):.2f}"
        else:
            last = "-" if analytic is None else f"{analytic:.2f}"
        table.add_row(
            str(row["schedule"]),
            *(str(row.get(field, "-")) for field, _ in extra),
            str(row["degree"]),
            str(row["virtual_stages"]),
            str(row["microbatches"]),
            f"{row['makespan']:.2f}",
            f"{100 * row['bubble_fraction_mean']:.1f}",
            f"{100 * max(fractions):.1f}",
            str(max(row["peak_activations_per_rank"], default=0)),
            str(row["param_copies"]),
            last,
        )
    return table


# ---- Chrome trace ---------------------------------------------------------------------------


def _step_args(step: Step) -> dict:
    if isinstance(step, Overlap):
        parts: tuple[Action, ...] = step.parts()
        return {"stages": [a.stage for a in parts], "microbatches": [a.microbatch for a in parts],
                "forward": str(step.forward), "backward": str(step.backward)}
    return {"stage": step.stage, "microbatch": step.microbatch}


def chrome_trace(result: SimResult) -> dict:
    """Chrome trace event format (chrome://tracing, ui.perfetto.dev): one complete ("X")
    event per step on thread `rank`, plus a live-activations counter ("C") per rank; under data
    parallel each rank's gradient reductions on a track of their own under it."""
    P = result.schedule.num_ranks
    trace = ChromeTrace(f"pipetrain simulate {result.schedule.name}")
    for r in range(P):
        trace.thread(r, f"rank {r}", sort_index=2 * r)
    for r, row in enumerate(result.timeline):
        for ts in row:
            trace.slice(r, str(ts.step), op_name(ts.step), ts.start, ts.end - ts.start, _step_args(ts.step))
    for r, lane in enumerate(result.reductions):
        trace.reductions(r, P, [(sp.stage, sp.start, sp.end) for sp in lane])
    for r, row in enumerate(result.timeline):
        trace.counter(f"live activations rank {r}", [(0.0, 0), *live_activations(row)])
    return trace.to_json()
