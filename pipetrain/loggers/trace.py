"""`logger=[...,trace]`: trace.json, a Chrome trace of one measured step (logging.trace_step,
default the last), for chrome://tracing or ui.perfetto.dev.

One row (thread) per rank, every rank on one time axis. Per action a slice named as the
schedule text names it ("0F3": stage 0, forward, microbatch 3), coloured by op (F blue,
B green, W orange, BW dark green, F&B red, as far as the viewer honours `cname`), drawn where
the action computed; before it, a grey "wait" slice for the time it sat blocked in a
receive; each send is an instant event with a flow arrow to the receive that took it.
A counter per rank shows the live activation sets, as schedule_trace.json does for the
simulated schedule.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pipetrain.loggers.base import Logger
from pipetrain.metrics.measure import StepMeasurement
from pipetrain.metrics.records import CommEvent
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.schedules.render import op_name
from pipetrain.schedules.simulate import live_activations

CNAME = {"F": "rail_response", "B": "rail_load", "W": "rail_idle", "BW": "good", "F&B": "rail_animation"}
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


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)  # trace times are microseconds


def _describe(e: CommEvent) -> str:
    op = "F" if e.kind == "act" else "B"
    return f"{WHAT[e.kind]} of {e.stage}{op}{e.microbatch}"


def _flow_id(e: CommEvent, num_microbatches: int) -> int:
    return (e.stage * num_microbatches + e.microbatch) * 2 + (e.kind == "grad") + 1


def _rank_events(m: StepMeasurement, r: int) -> list[dict[str, Any]]:
    sched, sample, off = m.schedule, m.samples[r], m.offsets_ms[r]
    steps, M = sched.steps[r], sched.num_microbatches
    recv_end: dict[int, float] = {}
    events: list[dict[str, Any]] = []
    for e in sample.comm:
        if e.direction == "recv":
            recv_end[e.action] = max(recv_end.get(e.action, 0.0), e.end_ms)
            events.append({"name": f"wait: {_describe(e)} from rank {e.peer}", "cat": "recv", "ph": "X",
                           "pid": 0, "tid": r, "ts": _us(off + e.start_ms), "dur": _us(e.end_ms - e.start_ms),
                           "cname": "grey", "args": {"from_rank": e.peer, "kind": e.kind, "stage": e.stage,
                                                     "microbatch": e.microbatch}})
            events.append({"name": _describe(e), "cat": "p2p", "ph": "f", "bp": "e", "pid": 0, "tid": r,
                           "ts": _us(off + e.end_ms), "id": _flow_id(e, M)})
        else:
            events.append({"name": f"send {_describe(e)} to rank {e.peer}", "cat": "send", "ph": "i", "s": "t",
                           "pid": 0, "tid": r, "ts": _us(off + e.start_ms)})
            events.append({"name": _describe(e), "cat": "p2p", "ph": "s", "pid": 0, "tid": r,
                           "ts": _us(off + e.start_ms), "id": _flow_id(e, M)})
    for t in sample.timings:
        step = steps[t.index]
        parts = step.parts()
        # A one-part action receives before it computes: draw it from when its input was there.
        start = recv_end.get(t.index, t.start_ms) if len(parts) == 1 else t.start_ms
        op = op_name(step)
        events.append({"name": t.step, "cat": op, "ph": "X", "pid": 0, "tid": r, "ts": _us(off + start),
                       "dur": _us(t.end_ms - start), "cname": CNAME[op],
                       "args": {"stages": [a.stage for a in parts], "microbatches": [a.microbatch for a in parts],
                                "compute_ms": round(t.compute_ms, 4), "wait_ms": round(t.wait_ms, 4)}})
    return events


def measured_trace(m: StepMeasurement) -> dict[str, Any]:
    """Chrome trace event format of one measured step (see the module docstring)."""
    sched = m.schedule
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {
        "name": f"pipetrain {sched.name} P={sched.num_ranks} M={sched.num_microbatches}: step {m.step} (measured)"}}]
    for r in range(sched.num_ranks):
        stages = "|".join(map(str, sched.placement.stages_of(r)))
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                       "args": {"name": f"rank {r} (stage {stages})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for r in range(sched.num_ranks):
        events += _rank_events(m, r)
        for t, live in live_activations(m.measured.timeline[r]):
            events.append({"name": f"live activations rank {r}", "ph": "C", "pid": 0, "ts": _us(t),
                           "args": {"sets": live}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": m.step, "schedule": sched.name, "bubble_fraction_mean": m.bubble_mean,
                          "simulated_bubble_fraction": m.simulated.bubble_fraction_mean}}
