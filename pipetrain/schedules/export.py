"""What timelines and numbers become on disk: one rounding rule for JSON, one Chrome-trace writer.

Both the simulated schedule (schedule_trace.json, schedules/render.py) and a measured training
step (trace.json, loggers/trace.py) are written through `ChromeTrace`, and every JSON number
pipetrain writes (simulate.json, metrics.jsonl, summary.json, the traces) is rounded by
`rounded`. Pure Python, no torch.

Chrome trace event format (chrome://tracing, ui.perfetto.dev): one process (pid 0), one
thread per rank (tid = rank); "X" slices, "i" instants, "s"/"f" flow arrows, "C" counters,
"M" metadata. Times come in as milliseconds and go out as microseconds. Under data parallel
each rank's gradient reductions get a row of their own (`reductions`), sorted under the rank's
(rank rows take sort index 2 x rank).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

JSON_DIGITS = 6  # ms to the nanosecond; fractions to 1e-6


def rounded(x: float, digits: int = JSON_DIGITS) -> float:
    """The one rounding of numbers written as JSON (a float, whatever came in)."""
    return round(float(x), digits)


def us(ms: float) -> float:
    """Trace times are microseconds; keep nanosecond precision."""
    return rounded(ms * 1000.0, 3)


class ChromeTrace:
    """Events of one trace, in the order they are added."""

    def __init__(self, process_name: str) -> None:
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process_name}}]

    def thread(self, tid: int, name: str, *, sort_index: Optional[int] = None) -> None:
        """Name a row and place it (default: rows in tid order)."""
        self.events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
        self.events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                            "args": {"sort_index": tid if sort_index is None else sort_index}})

    def slice(self, tid: int, name: str, cat: str, start_ms: float, dur_ms: float, args: dict[str, Any], *,
              cname: Optional[str] = None) -> None:
        """A complete event: `dur_ms` from `start_ms` on row `tid` (`cname`: a colour the viewer may honour)."""
        event = {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": us(start_ms), "dur": us(dur_ms)}
        if cname is not None:
            event["cname"] = cname
        event["args"] = args
        self.events.append(event)

    def reductions(self, rank: int, num_ranks: int, spans: Iterable[tuple[int, float, float]], *,
                   cname: Optional[str] = None) -> None:
        """A rank's gradient reductions, (stage, start ms, end ms), on a row right under the rank's."""
        tid = num_ranks + rank
        self.thread(tid, f"rank {rank} gradient reduction", sort_index=2 * rank + 1)
        for stage, start, end in spans:
            self.slice(tid, f"{stage}REDUCE_GRAD", "reduce", start, end - start, {"stage": stage}, cname=cname)

    def instant(self, tid: int, name: str, cat: str, at_ms: float) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "pid": 0, "tid": tid, "ts": us(at_ms)})

    def flow(self, tid: int, name: str, at_ms: float, flow_id: int, *, start: bool) -> None:
        """One end of an arrow between rows: the start ("s") or the end ("f", bound to the enclosing slice)."""
        event: dict[str, Any] = {"name": name, "cat": "p2p", "ph": "s" if start else "f"}
        if not start:
            event["bp"] = "e"
        event.update(pid=0, tid=tid, ts=us(at_ms), id=flow_id)
        self.events.append(event)

    def counter(self, name: str, points: Iterable[tuple[float, int]], key: str = "sets") -> None:
        """A counter track: (time ms, value) points. Counters belong to a process in the format,
        so what they count (e.g. the rank) goes in the name."""
        for t, value in points:
            self.events.append({"name": name, "ph": "C", "pid": 0, "ts": us(t), "args": {key: value}})

    def to_json(self, other_data: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        out: dict[str, Any] = {"traceEvents": self.events, "displayTimeUnit": "ms"}
        if other_data is not None:
            out["otherData"] = other_data
        return out
