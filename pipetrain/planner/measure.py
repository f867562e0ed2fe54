"""`plan.calibrate=true`: measure this machine before planning.

Two short runs on the local ranks (the plan's world as pp2 x dp(world/2), the microbatch size of
the uncalibrated plan's best row, metrics every step): zbh1 (each stage half the layers) and zbv
(four stages, a quarter each), so that F, B and W are timed apart at two stage sizes; a third at
the smallest tp > 1 in plan.tp, if any, prices one TP collective (plan.tp_latency_ms). Their
metrics against the planner's own per-layer costs (planner/cmd.py's Workload: the profile's on a
real model, the configured sleeps on model=sleep) fit the `plan` overheads
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
from pipetrain.partition.costs import chunk_costs
from pipetrain.planner.calibrate import OPS, overheads, tp_latency
from pipetrain.planner.degrees import tp_degrees
from pipetrain.planner.workload import Workload
from pipetrain.schedules.tp_cost import tp_rank_layers
from pipetrain.planner.space import Candidate
from pipetrain.schedules.tp_cost import collectives

KEYS = ("action_overhead_ms", "layer_overhead_ms", "reduce_latency_ms", "step_overhead_ms", "tp_latency_ms")
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
                mbs: int, partition: str, pp: int = 2, tp: int = 1) -> Config:
    cfg = row_config(Candidate(schedule, pp, dp, v, 4, mbs, partition=partition, tp=tp))
    return dataclasses.replace(
        cfg, logger=["jsonl"], plan=dataclasses.replace(cfg.plan, run=False, calibrate=False),
        trainer=dataclasses.replace(cfg.trainer, max_steps=config.plan.calibrate_steps, log_every=1, eval_every=0,
                                    ckpt_every=0, ckpt_at_end=False, activation_checkpointing=False,
                                    recompute="none"))


def calibrate(config: Config, work: Workload, *, world: int, mbs: int, partition: str,
              row_config: Callable[[Candidate], Config], run_dir: Path,
              note: Callable[[str], Any] = print) -> dict[str, float]:
    """The overheads (plan.<key>, KEYS; tp_latency_ms only where plan.tp lists tp > 1) fitted from
    the runs, rounded to 1 us. `row_config`: the config that trains a candidate (planner/cmd.py's
    apply_row); `partition`: the planner's strategy name for the configured partition."""
    from pipetrain.launch import prestart

    check(config, world)
    prestart(config)
    layers = list(work.layers(mbs))
    runs = []
    for schedule, v in RUNS:
        cfg = _run_config(config, row_config, schedule, v, world // 2, mbs, partition)
        rows, step_ms, plan = _train(cfg, run_dir / CALIBRATION_DIR / schedule, note)
        pl, bounds = plan.schedule.placement, plan.partition.bounds
        chunks = chunk_costs(layers, bounds)
        stages = range(pl.num_stages)
        model = {op: [chunks[pl.chunk_of(s)][i] for s in stages] for i, op in enumerate(OPS)}
        runs.append((rows, step_ms, [len(bounds[pl.chunk_of(s)]) for s in stages], model))
    cal = overheads(runs)
    tps = [t for t in tp_degrees(config) if t > 1 and world % t == 0]
    if tps:  # the cost of one TP collective, from one run at the smallest tp > 1 listed
        tp = min(tps)
        pp = 2 if world % (2 * tp) == 0 else 1
        cfg = _run_config(config, row_config, "1f1b", 1, world // (pp * tp), mbs, partition, pp=pp, tp=tp)
        rows, _, plan = _train(cfg, run_dir / CALIBRATION_DIR / f"tp{tp}", note)
        split = tp_rank_layers(layers, tp=tp, sequence_parallel=False, tokens=mbs * work.seq, hidden=work.hidden,
                               vocab=work.vocab, value_bytes=work.value_bytes,
                               bandwidth_gbs=config.cluster.tp_bandwidth_gbs)
        pl, bounds = plan.schedule.placement, plan.partition.bounds
        ranges = [bounds[pl.chunk_of(s)] for s in range(pl.num_stages)]
        cal["tp_latency_ms"] = tp_latency(
            rows, model_f_ms=[chunk_costs(split, [r])[0][0] for r in ranges], layers=[len(r) for r in ranges],
            collectives=[sum(collectives(split[i].name)[0] for i in r) for r in ranges],
            action_ms=cal["action_overhead_ms"], layer_ms=cal["layer_overhead_ms"])
    return {k: round(v, 3) for k, v in cal.items()}


def _train(cfg: Config, out: Path, note: Callable[[str], Any]) -> tuple[list[dict], float, Any]:
    """Train one calibration run into `out`: its metrics rows after the first step, its median step
    time (ms) and its Plan."""
    from pipetrain.launch import launch
    from pipetrain.plan import make_plan

    plan = make_plan(cfg)
    par = cfg.parallel
    note(f"plan.calibrate: {cfg.plan.calibrate_steps} steps of {cfg.schedule.name}, "
         f"pp{cfg.pipeline.degree} x dp{par.dp}"
         + (f" x tp{par.tp}" if par.tp > 1 else "") + f", microbatch {cfg.microbatch_size} -> {out}")
    launch(cfg, plan, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    step_s = json.loads((out / "summary.json").read_text()).get(names.STEP_TIME)
    if not step_s:
        raise ValueError(
            f"plan.calibrate: the {cfg.schedule.name} run measured no step time: raise plan.calibrate_steps")
    return rows, step_s * 1e3, plan


def calibrated(config: Config, cal: dict[str, float]) -> Config:
    """The config whose plan group carries the fitted overheads."""
    return dataclasses.replace(config, plan=dataclasses.replace(config.plan, **{k: cal[k] for k in KEYS if k in cal}))
