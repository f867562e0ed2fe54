"""`logger=[...,trace]`: trace.json, a Chrome trace of one measured step (logging.trace_step,
default the last), for chrome://tracing or ui.perfetto.dev.

One row (thread) per rank, every rank on one time axis. Per action a slice named as the
schedule text names it ("0F3": stage 0, forward, microbatch 3), coloured by op (F blue,
B green, W orange, BW dark green, F&B red, as far as the viewer honours `cname`), drawn where
the action computed; before it, a grey "wait" slice for the time it sat blocked in a
receive; each send is an instant event with a flow arrow to the receive that took it.
A counter per rank shows the live activation sets, as schedule_trace.json does for the
simulated schedule. Under data parallel each rank's gradient reductions get a row under the
rank, each drawn from its issue to when the executor saw it done (between actions, or in
the step's final wait). The collectives inside the actions (runtime/collectives.py) get rows of their
own under the rank, "rank r all-to-all / cp": each expert-parallel all-to-all ("a2a:dispatch",
"a2a:combine B", node mode's "a2a:dispatch L3 mb5 F") and each cp transfer ("cp:allgather",
"cp:ring") from its issue to its arrival, with its bytes and exposed ms, and a "blocked" slice
inside it where the rank waited for part of it only (all-to-alls in flight at once take a row
each); a stage run node by node shows its nodes on a row "rank r nodes".
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pipetrain.loggers.base import Logger
from pipetrain.metrics import names
from pipetrain.metrics.measure import StepMeasurement
from pipetrain.metrics.records import CollectiveEvent, CommEvent
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.schedules.export import ChromeTrace, rounded
from pipetrain.schedules.render import op_name
from pipetrain.schedules.simulate import live_activations

CNAME = {"F": "rail_response", "B": "rail_load", "W": "rail_idle", "BW": "good", "F&B": "rail_animation",
         "ep": "thread_state_iowait", "cp": "olive", "node": "thread_state_running"}
WHAT = {"act": "activation", "grad": "input gradient"}


class TraceLogger(Logger):
    written = False

    def log(self, record: StepRecord) -> None:
        if record.measurement is not None and record.step == self.info.chosen_step:  # as soon as it is measured
            self.write(record.measurement)

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        if not self.written and chosen is not None and chosen.measurement is not None:  # resumed past trace_step
            self.write(chosen.measurement)

    def write(self, measurement: StepMeasurement) -> None:
        (self.info.run_dir / "trace.json").write_text(json.dumps(measured_trace(measurement)) + "\n")
        self.written = True


def _describe(e: CommEvent) -> str:
    op = "F" if e.kind == "act" else "B"
    return f"{WHAT[e.kind]} of {e.stage}{op}{e.microbatch}"


def _flow_id(e: CommEvent, num_microbatches: int) -> int:
    return (e.stage * num_microbatches + e.microbatch) * 2 + (e.kind == "grad") + 1


def _rank_events(trace: ChromeTrace, m: StepMeasurement, r: int) -> None:
    sched, sample, off = m.schedule, m.samples[r], m.offsets_ms[r]
    steps, M = sched.steps[r], sched.num_microbatches
    recv_end: dict[int, float] = {}
    for e in sample.comm:
        if e.direction == "recv":
            recv_end[e.action] = max(recv_end.get(e.action, 0.0), e.end_ms)
            trace.slice(r, f"wait: {_describe(e)} from rank {e.peer}", "recv", off + e.start_ms, e.end_ms - e.start_ms,
                        {"from_rank": e.peer, "kind": e.kind, "stage": e.stage, "microbatch": e.microbatch},
                        cname="grey")
            trace.flow(r, _describe(e), off + e.end_ms, _flow_id(e, M), start=False)
        else:
            trace.instant(r, f"send {_describe(e)} to rank {e.peer}", "send", off + e.start_ms)
            trace.flow(r, _describe(e), off + e.start_ms, _flow_id(e, M), start=True)
    for t in sample.timings:
        step = steps[t.index]
        parts = step.parts()
        # A one-part action receives before it computes: draw it from when its input was there.
        start = recv_end.get(t.index, t.start_ms) if len(parts) == 1 else t.start_ms
        op = op_name(step)
        trace.slice(r, t.step, op, off + start, t.end_ms - start,
                    {"stages": [a.stage for a in parts], "microbatches": [a.microbatch for a in parts],
                     "compute_ms": rounded(t.compute_ms, 4), "wait_ms": rounded(t.wait_ms, 4)}, cname=CNAME[op])


def _lanes(events: list[CollectiveEvent]) -> list[list[CollectiveEvent]]:
    """Events in rows where none overlaps another (a viewer nests the slices of one row)."""
    lanes: list[list[CollectiveEvent]] = []
    for e in sorted(events, key=lambda c: c.start_ms):
        lane = next((lane for lane in lanes if lane[-1].end_ms <= e.start_ms), None)
        if lane is None:
            lanes.append(lane := [])
        lane.append(e)
    return lanes


def _collectives(trace: ChromeTrace, m: StepMeasurement, r: int, tid: int) -> int:
    """Rank r's collectives and nodes on rows from `tid` on, right under the rank's; the next free tid."""
    events = [c for t in m.samples[r].timings for c in t.collectives]
    off = m.offsets_ms[r]
    for kind, name in (("comm", "all-to-all / cp"), ("node", "nodes")):
        for i, lane in enumerate(_lanes([c for c in events if (c.group == "node") == (kind == "node")])):
            trace.thread(tid, f"rank {m.global_ranks[r]} {name}" + (f" {i + 1}" if i else ""), sort_index=2 * r + 1)
            for c in lane:
                trace.slice(tid, c.label, c.group, off + c.start_ms, c.total_ms,
                            {"bytes": c.nbytes, "exposed_ms": rounded(c.exposed_ms, 4)}, cname=CNAME[c.group])
                if 0 < c.exposed_ms < c.total_ms:
                    trace.slice(tid, "blocked", "blocked", off + c.wait_from_ms, c.exposed_ms, {}, cname="grey")
            tid += 1
    return tid


def measured_trace(m: StepMeasurement) -> dict[str, Any]:
    """Chrome trace event format of one measured step (see the module docstring)."""
    sched = m.schedule
    trace = ChromeTrace(f"pipetrain {sched.name} P={sched.num_ranks} M={sched.num_microbatches}: "
                        f"step {m.step} (measured)")
    P = sched.num_ranks
    for r in range(P):  # named by global rank: under data / tensor parallel, pipeline 0's
        trace.thread(r, f"rank {m.global_ranks[r]} (stage {'|'.join(map(str, sched.placement.stages_of(r)))})",
                     sort_index=2 * r)
    for r in range(P):
        _rank_events(trace, m, r)
        trace.counter(f"live activations rank {m.global_ranks[r]}", live_activations(m.measured.timeline[r]))
    for r, lane in enumerate(m.measured.reductions):
        trace.reductions(r, P, [(sp.stage, sp.start, sp.end) for sp in lane], cname="generic_work")
    tid = 2 * P  # after the ranks' rows and their reductions' (ChromeTrace.reductions: P + r)
    for r in range(P):
        tid = _collectives(trace, m, r, tid)
    return trace.to_json({"step": m.step, "schedule": sched.name, names.BUBBLE: m.bubble_mean,
                          names.BUBBLE_SIM: m.simulated.bubble_fraction_mean})
