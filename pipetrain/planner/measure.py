"""`plan.calibrate=true`: measure this machine before planning.

Two short runs on the local ranks (the plan's world as pp2 x dp(world/2), the microbatch size of
the uncalibrated plan's best row, metrics every step): zbh1 (each stage half the layers) and zbv
(four stages, a quarter each), so that F, B and W are timed apart at two stage sizes. Their
metrics against the planner's own per-layer costs (planner/cmd.py's Workload: the profile's on a
real model, the configured sleeps on model=sleep) fit the four `plan` overheads
(planner/calibrate.py); the plan is then searched with them. bench/planner_accuracy.py calibrates
through this function too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from pipetrain.config import Config
from pipetrain.metrics import names
from pipetrain.models.costs import chunk_costs
from pipetrain.planner.calibrate import OPS, overheads
from pipetrain.planner.search import Candidate, Workload

KEYS = ("action_overhead_ms", "layer_overhead_ms", "reduce_latency_ms", "step_overhead_ms")
RUNS = (("zbh1", 1), ("zbv", 2))  # (schedule, stages per rank) on pp2: 2 and 4 stages
CALIBRATION_DIR = "calibrate"


def check(config: Config, world: int) -> None:
    """What a calibration run needs, one line each, before anything runs."""
    if config.cluster.name != "local":
        raise ValueError(f"plan.calibrate trains short runs on this machine's ranks (cluster=local); with "
                         f"cluster={config.cluster.name} set plan.calibrate=false and the plan.*_overhead_ms keys")
    if world < 2 or world % 2:
        raise ValueError(f"plan.calibrate runs pp2 x dp(world/2): it needs an even world of >= 2 ranks (got {world}): "
                         f"set plan.world_size or plan.calibrate=false")
    if config.model.num_layers < 4:
        raise ValueError(f"plan.calibrate runs zbv's 4 stages: model={config.model.name} has "
                         f"{config.model.num_layers} layers: set plan.calibrate=false")


def _run_config(config: Config, row_config: Callable[[Candidate], Config], schedule: str, v: int, dp: int,
                mbs: int, partition: str) -> Config:
    cfg = row_config(Candidate(schedule, 2, dp, v, 4, mbs, partition=partition))
    return dataclasses.replace(
        cfg, logger=["jsonl"], plan=dataclasses.replace(cfg.plan, run=False, calibrate=False),
        trainer=dataclasses.replace(cfg.trainer, max_steps=config.plan.calibrate_steps, log_every=1, eval_every=0,
                                    ckpt_every=0, ckpt_at_end=False, activation_checkpointing=False))


def calibrate(config: Config, work: Workload, *, world: int, mbs: int, partition: str,
              row_config: Callable[[Candidate], Config], run_dir: Path,
              note: Callable[[str], Any] = print) -> dict[str, float]:
    """The four overheads (plan.<key>) fitted from the two short runs, rounded to 1 us.
    `row_config`: the config that trains a candidate (planner/cmd.py's apply_row); `partition`: the
    planner's strategy name for the configured partition."""
    from pipetrain.launch import launch, prestart
    from pipetrain.plan import make_plan

    check(config, world)
    prestart(config)
    layers = list(work.layers(mbs))
    runs = []
    for schedule, v in RUNS:
        cfg = _run_config(config, row_config, schedule, v, world // 2, mbs, partition)
        plan = make_plan(cfg)
        out = run_dir / CALIBRATION_DIR / schedule
        note(f"plan.calibrate: {cfg.plan.calibrate_steps} steps of {schedule}, pp2 x dp{world // 2}, "
             f"microbatch {mbs} -> {out}")
        launch(cfg, plan, out)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
        step_s = json.loads((out / "summary.json").read_text()).get(names.STEP_TIME)
        if not step_s:
            raise ValueError(f"plan.calibrate: the {schedule} run measured no step time: raise plan.calibrate_steps")
        pl, bounds = plan.schedule.placement, plan.partition.bounds
        chunks = chunk_costs(layers, bounds)
        stages = range(pl.num_stages)
        model = {op: [chunks[pl.chunk_of(s)][i] for s in stages] for i, op in enumerate(OPS)}
        runs.append((rows, step_s * 1e3, [len(bounds[pl.chunk_of(s)]) for s in stages], model))
    return {k: round(v, 3) for k, v in overheads(runs).items()}


def calibrated(config: Config, cal: dict[str, float]) -> Config:
    """The config whose plan group carries the fitted overheads."""
    return dataclasses.replace(config, plan=dataclasses.replace(config.plan, **{k: cal[k] for k in KEYS}))
