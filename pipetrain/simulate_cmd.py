"""`mode=simulate`: validate and simulate the configured schedule, print it, write JSON.

No process group and no torch.distributed: everything here is pure Python.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from pipetrain.config import Config
from pipetrain.plan import make_plan
from pipetrain.schedules import render
from pipetrain.schedules.simulate import SimResult, simulate


def run_simulate(config: Config, run_dir: Path, console: Console | None = None) -> dict:
    """Simulate, print the timeline and summary, write simulate.json, schedule_trace.json, schedule.csv."""
    console = console or Console()
    plan = make_plan(config)
    result: SimResult = simulate(
        plan.schedule, plan.stage_costs, comm_ms=config.sim.comm_ms, fb_overlap=config.sim.fb_overlap, check=False
    )
    record = render.result_record(
        result,
        schedule_name=plan.schedule.name,
        analytic_bubble=plan.analytic_bubble,
        param_copies=plan.schedule.placement.param_copies,
        virtual_stages=plan.schedule.placement.stages_per_rank,
    )
    if config.sim.timeline:
        console.print(render.render_timeline(result, width=config.sim.timeline_width or None))
    console.print(render.summary_table([record]))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "simulate.json").write_text(json.dumps(record, indent=2) + "\n")
    (run_dir / "schedule_trace.json").write_text(json.dumps(render.chrome_trace(result)) + "\n")
    (run_dir / "schedule.csv").write_text(plan.schedule.to_csv())
    console.print(f"wrote {run_dir / 'simulate.json'}, schedule_trace.json (open in ui.perfetto.dev), schedule.csv")
    return record
