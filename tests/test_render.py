"""Timeline, summary table, simulate.json record and Chrome trace of simulated schedules.

Schedules are written by hand (Schedule.from_text / build) so these tests do not
depend on any generator."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from pipetrain.schedules.ir import Action, Op, Overlap, Schedule
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.render import (
    chrome_trace,
    render_timeline,
    result_record,
    summary_table,
    timeline_lines,
)
from pipetrain.schedules.simulate import SimResult, StageCosts, simulate

pytestmark = pytest.mark.pure


def one_f_one_b(P: int, M: int, *, split_backward: bool = False) -> Schedule:
    """1F1B (warm-up P-1-r forwards, then one F one backward). With split_backward the
    backward is B then W, rank 0 deferring all its Ws to the end (a ZB-H1-like tail)."""
    lines = []
    for r in range(P):
        warm = min(P - 1 - r, M)
        toks, deferred, f = [f"{r}F{m}" for m in range(warm)], [], warm
        for b in range(M):
            if f < M:
                toks.append(f"{r}F{f}")
                f += 1
            if not split_backward:
                toks.append(f"{r}BW{b}")
            elif r == 0:
                toks.append(f"{r}B{b}")
                deferred.append(f"{r}W{b}")
            else:
                toks += [f"{r}B{b}", f"{r}W{b}"]
        lines.append(f"rank {r}: " + " ".join(toks + deferred))
    name = "zb_like" if split_backward else "1f1b"
    return Schedule.from_text("\n".join(lines), name=name, placement=Placement.loop(P), num_microbatches=M)


def vshape_bfs(P: int, M: int) -> Schedule:
    """V placement, breadth first: all Fs of the down leg, all of the up leg, then B/W of
    the up leg and of the down leg: 6M actions per rank (192 for M=32, like ZB-V)."""
    rows = []
    for r in range(P):
        down, up = r, 2 * P - 1 - r
        row = [Action(Op.F, down, m) for m in range(M)] + [Action(Op.F, up, m) for m in range(M)]
        for s in (up, down):
            for m in range(M):
                row += [Action(Op.B, s, m), Action(Op.W, s, m)]
        rows.append(row)
    return Schedule.build("vshape_bfs", Placement.vshape(P), M, rows)


MIRROR2 = """
rank 0: 0F0 3F2 0F1&3BW2 3F3 0BW0 3BW3 0BW1
rank 1: 2F2 1F0 2F3&1BW0 1F1 2BW2 1BW1 2BW3
"""


def mirror2() -> Schedule:
    """DualPipe-like on mirror(2): mb 0,1 enter at rank 0, mb 2,3 at rank 1, one F&B pair per rank."""
    return Schedule.from_text(MIRROR2, name="mirror2", placement=Placement.mirror(2), num_microbatches=4)


def rendered(result: SimResult, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render_timeline(result))
    return console.export_text()


def rank_rows(text: str, P: int) -> dict[int, str]:
    """Each rank's cells, the bands concatenated in order."""
    rows = {r: "" for r in range(P)}
    for line in text.splitlines():
        m = re.match(r"^\s*rank (\d+) │(.*)$", line)
        if m:
            rows[int(m.group(1))] += m.group(2)
    return rows


def ms_per_column(text: str) -> float:
    return float(re.search(r"1 column = ([\d.e+-]+) ms", text).group(1))


def bands(text: str) -> int:
    m = re.search(r"band 1/(\d+)", text)
    return int(m.group(1)) if m else 1


def assert_cells_match_sim(text: str, result: SimResult) -> None:
    """Every rank row spans the makespan, and its busy cells are its busy time (nothing lost)."""
    col = ms_per_column(text)
    rows = rank_rows(text, result.schedule.num_ranks)
    lengths = {len(row) for row in rows.values()}
    assert len(lengths) == 1, lengths
    assert lengths.pop() == pytest.approx(result.makespan / col, abs=1)
    for r, row in rows.items():
        busy_cells = len(row) - row.count("·")
        assert busy_cells == round(result.busy_per_rank[r] / col), (r, row)


# ---- timeline ------------------------------------------------------------------------------


def test_small_1f1b_timeline_one_band_with_every_microbatch():
    res = simulate(one_f_one_b(4, 8))
    text = rendered(res, width=100)
    assert bands(text) == 1 and "band 1/" not in text
    rows = rank_rows(text, 4)
    for r in range(4):
        labels = re.findall(r"(BW|F)(\d+)", rows[r])
        expected = [("F", str(m)) for m in range(8)] + [("BW", str(m)) for m in range(8)]
        assert sorted(labels) == sorted(expected)
    assert "makespan 33.000 ms" in text and "1f1b: P=4 v=1 M=8" in text
    assert "legend:" in text and "idle" in text
    assert_cells_match_sim(text, res)
    # idle is dots: rank 0 waits (P-1)*(F+BW) = 9 ms in total
    assert rows[0].count("·") == round(res.idle_per_rank[0] / ms_per_column(text))
    assert all(len(line) <= 100 for line in text.splitlines())


def test_split_backward_timeline_shows_b_and_w():
    res = simulate(one_f_one_b(4, 8, split_backward=True), StageCosts.uniform(4, 1.0, 1.0, 0.5))
    text = rendered(res, width=160)
    rows = rank_rows(text, 4)
    for m in range(8):
        assert re.search(rf"B{m}(?!\d)", rows[0]) and re.search(rf"W{m}(?!\d)", rows[0])
    assert " B " in text and " W " in text  # legend swatches
    assert_cells_match_sim(text, res)


def test_narrow_width_wraps_into_bands_without_losing_steps():
    res = simulate(one_f_one_b(4, 8))
    text = rendered(res, width=40)
    n = bands(text)
    assert n > 1
    for r in range(4):
        assert len(re.findall(rf"^\s*rank {r} │", text, flags=re.M)) == n
    assert all(len(line) <= 40 for line in text.splitlines() if "│" in line)
    assert_cells_match_sim(text, res)
    assert "not drawn" not in text


def test_large_vshape_192_actions_per_rank_stays_within_band_cap():
    sched = vshape_bfs(8, 32)
    assert all(len(row) == 192 for row in sched.steps)
    res = simulate(sched)
    for width in (80, 120, 200):
        text = rendered(res, width=width)
        assert 1 <= bands(text) <= 12
        assert all(f"rank {r} │" in text for r in range(8))
        assert_cells_match_sim(text, res)
        assert "not drawn" not in text
    # later stage of a V rank: lower case ops; first stage upper case
    text = rendered(res, width=200)
    assert re.search(r"f\d", text) and re.search(r"F\d", text) and re.search(r"w\d", text)
    assert "2 stages per rank" in text


def test_too_narrow_compresses_to_the_band_cap():
    res = simulate(vshape_bfs(8, 32))
    text = rendered(res, width=20)
    assert bands(text) == 12
    assert ms_per_column(text) > 1.0  # a column covers more than one 1 ms step
    assert all(len(line) <= 20 for line in text.splitlines() if "│" in line)
    rows = rank_rows(text, 8)
    assert all(len(row) - row.count("·") > 0 for row in rows.values())


def test_resolution_falls_back_to_one_column_per_shortest_step():
    res = simulate(vshape_bfs(8, 32))  # every step 1 ms, makespan 220 ms
    label_w = len("rank 7 ") + 2
    width = label_w + 220 // 12 + 1  # 12 bands of one column per ms fit, two columns per ms do not
    text = rendered(res, width=width)
    assert ms_per_column(text) == 1.0 and bands(text) <= 12
    assert_cells_match_sim(text, res)
    assert "not drawn" not in text


def test_compressed_steps_take_a_free_column():
    # W of 0.01 ms is far narrower than a column; where idle follows it, it still shows.
    res = simulate(one_f_one_b(4, 8, split_backward=True), StageCosts.uniform(4, 1.0, 1.0, 0.01))
    text = "\n".join(line.plain for line in timeline_lines(res, 60, max_bands=1))
    m = re.search(r"\((\d+) steps narrower than a column not drawn\)", text)
    assert m and 0 < int(m.group(1)) < 32
    rows = rank_rows(text, 4)
    # rank 3 (loss stage) runs B then W back to back, then idles in the cool-down: its last W shows
    assert rows[3].rstrip("·").endswith("B77")
    assert len(rows[3]) == len(rows[0])


def test_later_stage_is_bold_and_styles_differ_by_op():
    res = simulate(vshape_bfs(2, 2))
    lines = timeline_lines(res, 120)
    styles: dict[str, set[str]] = {}
    for line in lines:
        for span in line.spans:
            styles.setdefault(line.plain[span.start:span.end].strip(), set()).add(str(span.style))
    assert any("bold" in s for s in styles.get("f0", set()))
    assert not any("bold" in s for s in styles.get("F0", set()))
    assert styles["F0"].isdisjoint(styles["B0"]) and styles["B0"].isdisjoint(styles["W0"])


def test_overlap_pair_on_mirror_placement():
    res = simulate(mirror2())
    text = rendered(res, width=80)
    rows = rank_rows(text, 2)
    assert "1&2" in rows[0] and "3&0" in rows[1]
    assert "F&B" in text
    assert_cells_match_sim(text, res)


def test_render_timeline_uses_console_width_by_default():
    res = simulate(one_f_one_b(4, 8))
    wide, narrow = rendered(res, 120), rendered(res, 40)
    assert bands(wide) < bands(narrow)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_timeline(res, width=40))
    assert bands(console.export_text()) == bands(narrow)


# ---- result_record / summary_table ---------------------------------------------------------

RECORD_KEYS = {
    "schedule", "degree", "stages", "virtual_stages", "placement", "microbatches", "makespan",
    "busy_per_rank", "idle_per_rank", "bubble_fraction_per_rank", "bubble_fraction_mean",
    "peak_activations_per_rank", "param_copies", "analytic_bubble", "analytic_bubble_fraction",
    "comm_ms", "fb_overlap",
}


def test_result_record_keys_and_values():
    costs = StageCosts((1.0, 1.5, 1.0, 2.0), (1.0, 1.0, 1.0, 1.0), (0.5, 0.5, 1.0, 0.5))
    res = simulate(one_f_one_b(4, 8, split_backward=True), costs, comm_ms=0.1)
    assert len(set(res.bubble_fraction_per_rank)) > 1
    rec = result_record(res, schedule_name="1f1b", analytic_bubble=9.0, param_copies=1, virtual_stages=1)
    assert set(rec) == RECORD_KEYS
    assert (rec["degree"], rec["stages"], rec["microbatches"]) == (4, 4, 8)
    assert rec["placement"] == "loop" and rec["virtual_stages"] == 1 and rec["param_copies"] == 1
    assert rec["makespan"] == pytest.approx(res.makespan, abs=1e-6)
    assert rec["bubble_fraction_per_rank"] == pytest.approx(list(res.bubble_fraction_per_rank), abs=1e-6)
    assert rec["bubble_fraction_mean"] == pytest.approx(res.bubble_fraction_mean, abs=1e-6)
    assert rec["idle_per_rank"] == pytest.approx(list(res.idle_per_rank), abs=1e-6)
    assert rec["peak_activations_per_rank"] == list(res.peak_activations_per_rank)
    mean_busy = sum(res.busy_per_rank) / 4
    assert rec["analytic_bubble_fraction"] == pytest.approx(9.0 / (9.0 + mean_busy), abs=1e-6)
    assert rec["comm_ms"] == pytest.approx(0.1)
    assert json.loads(json.dumps(rec)) == rec
    none = result_record(res, schedule_name="x", analytic_bubble=None, param_copies=2, virtual_stages=1)
    assert none["analytic_bubble"] is None and none["analytic_bubble_fraction"] is None


def test_summary_table_one_and_many_rows():
    rows = [
        result_record(simulate(one_f_one_b(4, 8)), schedule_name="1f1b", analytic_bubble=9.0,
                      param_copies=1, virtual_stages=1),
        result_record(simulate(mirror2()), schedule_name="mirror2", analytic_bubble=None,
                      param_copies=2, virtual_stages=2),
    ]
    table = summary_table(rows, title="compare")
    assert [c.header.replace("\n", " ") for c in table.columns] == [
        "schedule", "P", "v", "M", "makespan ms", "bubble mean %", "bubble max %", "peak act",
        "param copies", "analytic bubble ms",
    ]
    assert table.row_count == 2
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(table)
    text = console.export_text()
    assert "1f1b" in text and "mirror2" in text and "33.00" in text and "9.00" in text
    narrow = Console(record=True, width=80, file=io.StringIO())
    narrow.print(table)
    assert "…" not in narrow.export_text()  # fits a plain 80-column terminal untruncated
    assert f"{100 * rows[0]['bubble_fraction_mean']:.1f}" in text
    assert re.search(r"mirror2.*\s-\s*$", text, re.M)
    assert summary_table(rows[:1]).row_count == 1


# ---- chrome trace -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda: one_f_one_b(4, 8, split_backward=True), mirror2, lambda: vshape_bfs(4, 8)]
)
def test_chrome_trace(make):
    res = simulate(make(), comm_ms=0.25)
    trace = json.loads(json.dumps(chrome_trace(res)))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    steps = [(r, ts) for r, row in enumerate(res.timeline) for ts in row]
    assert len(complete) == len(steps)
    assert sorted((e["tid"], e["name"]) for e in complete) == sorted((r, str(ts.step)) for r, ts in steps)
    for r in range(res.schedule.num_ranks):
        dur_us = sum(e["dur"] for e in complete if e["tid"] == r)
        assert dur_us / 1000 == pytest.approx(res.busy_per_rank[r], abs=1e-6)
        counter = f"live activations rank {r}"
        counts = [e["args"]["sets"] for e in events if e["ph"] == "C" and e["name"] == counter]
        assert max(counts) == res.peak_activations_per_rank[r] and min(counts) >= 0 and counts[-1] == 0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {f"rank {r}" for r in range(res.schedule.num_ranks)}
    proc = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert proc[0]["args"]["name"] == f"pipetrain simulate {res.schedule.name}"
    for e in complete:
        assert e["pid"] == 0 and e["cat"] in {"F", "B", "W", "BW", "F&B"}
        assert ("stages" in e["args"]) == (e["cat"] == "F&B")
    if any(isinstance(ts.step, Overlap) for _, ts in steps):
        pair = next(e for e in complete if e["cat"] == "F&B")
        assert pair["name"] in ("0F1&3BW2", "2F3&1BW0") and len(pair["args"]["microbatches"]) == 2


def test_chrome_trace_times_are_microseconds():
    res = simulate(one_f_one_b(2, 2), StageCosts.uniform(2, 1.5, 1.0, 1.0))
    first = next(e for e in chrome_trace(res)["traceEvents"] if e["ph"] == "X")
    assert first["name"] == "0F0" and first["ts"] == 0 and first["dur"] == pytest.approx(1500.0)


@pytest.mark.pure
def test_cut_cells_off_a_terminal_show_no_stray_digits():
    """A block too narrow for "B25" showed "25" (its colour told the op); off a terminal, in black
    and white, "b2929" read as one action. Piped output falls back to the op's letter instead."""
    from pipetrain.schedules import registry
    from pipetrain.schedules.render import timeline_lines

    res = simulate(registry.build("zbv", 4, 32, virtual_stages=2), StageCosts((1.0,) * 8, (1.0,) * 8, (0.4,) * 8))
    stray = re.compile(r"(?<![A-Za-z&\d])\d+")  # digits that follow no op letter

    def cells(plain: bool) -> str:
        return "".join(m.group(1) for line in timeline_lines(res, 100, plain=plain)
                       if (m := re.match(r"^\s*rank \d+ │(.*)$", line.plain)))

    assert stray.search(cells(plain=False))  # colour: bare microbatch numbers where "B25" does not fit
    assert not stray.search(cells(plain=True)), cells(plain=True)
    piped = Console(width=100, file=io.StringIO(), record=True)  # not a terminal: plain
    piped.print(render_timeline(res, width=100))
    assert not stray.search("".join(rank_rows(piped.export_text(), 4).values()))
