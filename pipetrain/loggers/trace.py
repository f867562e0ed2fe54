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
the step's final wait).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pipetrain.loggers.base import Logger
from pipetrain.metrics import names
from pipetrain.metrics.measure import StepMeasurement
from pipetrain.metrics.records import CommEvent
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.schedules.export import ChromeTrace, rounded
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


def measured_trace(m: StepMeasurement) -> dict[str, Any]:
    """Chrome trace event format of one measured step (see the module docstring)."""
    sched = m.schedule
    trace = ChromeTrace(f"pipetrain {sched.name} P={sched.num_ranks} M={sched.num_microbatches}: step {m.step} (measured)")
    P = sched.num_ranks
    for r in range(P):
        trace.thread(r, f"rank {r} (stage {'|'.join(map(str, sched.placement.stages_of(r)))})", sort_index=2 * r)
    for r in range(P):
        _rank_events(trace, m, r)
        trace.counter(f"live activations rank {r}", live_activations(m.measured.timeline[r]))
    for r, lane in enumerate(m.measured.reductions):
        trace.reductions(r, P, [(sp.stage, sp.start, sp.end) for sp in lane], cname="generic_work")
    return trace.to_json({"step": m.step, "schedule": sched.name, names.BUBBLE: m.bubble_mean,
                          names.BUBBLE_SIM: m.simulated.bubble_fraction_mean})
