"""`mode=simulate`: partition the model, validate and simulate the configured schedule,
print the partition table, the timeline and the summary, write JSON.

No process group and no torch.distributed. With model=sleep (and any partition but
profile) everything here is pure Python; real models build their cost model on torch's
meta device (see plan.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rich.console import Console

from pipetrain.config import Config, Mode
from pipetrain.loggers.tables import print_table
from pipetrain.parallel.table import rank_table
from pipetrain.partition.partition import Partition
from pipetrain.partition.table import compact_names, partition_table
from pipetrain.plan import Plan, make_plan
from pipetrain.schedules.lower import split_on
from pipetrain.schedules import render
from pipetrain.schedules.export import rounded
from pipetrain.schedules.gc_pause import gc_paused
from pipetrain.schedules.simulate import SimResult


# Rows of a table printed at most: past it a table costs seconds to lay out (4 s for P=10^4) and says
# nothing a reader takes in; simulate.json holds every stage ("partition") either way.
MAX_TABLE_ROWS = 256


def _too_many(what: str, n: int) -> str:
    return f"no table past {MAX_TABLE_ROWS} {what}s" + (f" (simulate.json lists all {n})" if what == "stage" else "")


def partition_record(part: Partition, *, model: str, cost_source: str) -> dict:
    """The "partition" object of simulate.json: one entry per model chunk (= stage, except
    DualPipe's mirror, where chunk c is stage c of one direction and of the other)."""
    return {
        "model": model,
        "strategy": part.strategy,
        "balanced_on": part.balanced_on,
        "cost_source": cost_source,
        "num_layers": part.num_layers,
        "boundaries": list(part.boundaries),
        "layers": [compact_names(part.layer_names(c)) for c in range(part.num_chunks)],
        "params": list(part.chunk_params()),
        "est_ms": [rounded(x) for x in part.chunk_time_ms()],  # f + b + w of one microbatch
        "imbalance": rounded(part.time_imbalance()),  # max/mean - 1 of est_ms
        "params_imbalance": rounded(part.imbalance("params")),
    }


def data_parallel_record(config: Config, plan: Plan) -> dict:
    """The "data_parallel" object of simulate.json: the layout and what each stage's reduction costs."""
    lay, par = config.layout, config.parallel
    assert plan.reduce_ms is not None
    return {
        "dp_replicate": lay.dp_replicate,
        "dp_shard": lay.dp_shard,
        "mode": lay.dp_mode,
        "reduce_dtype": par.reduce_dtype,
        "overlap_reduce": par.overlap_reduce,
        "dp_bandwidth_gbs": rounded(config.cluster.dp_bandwidth_gbs),
        "reduce_ms": [rounded(x) for x in plan.reduce_ms],  # per stage id
    }


def _reduce_note(config: Config, plan: Plan, result: SimResult) -> str:
    par = config.parallel
    where = "after each stage's last W" if par.overlap_reduce else "all at the step's end"
    per_stage = ", ".join(f"{x:.2f}" for x in plan.reduce_ms or ())
    exposed = ", ".join(f"{x:.2f}" for x in result.reduce_exposed_ms)
    return (f"data parallel: reduce {per_stage} ms per stage ({config.layout.dp_mode} in {par.reduce_dtype} at "
            f"cluster.dp_bandwidth_gbs={config.cluster.dp_bandwidth_gbs:g}), {where} "
            f"(parallel.overlap_reduce={str(par.overlap_reduce).lower()}); exposed per rank {exposed} ms")


def _cost_note(config: Config, plan: Plan) -> str:
    mb, seq = config.microbatch_size, config.data.seq_len
    shape = f"{mb} x {seq} tokens" if config.model.has_seq else f"{mb} samples"
    par, cl = config.parallel, config.cluster
    per_rank = (f"; per tp rank: 1/{par.tp} of it plus each layer's TP collectives at "
                f"cluster.tp_bandwidth_gbs={cl.tp_bandwidth_gbs:g}") if par.tp > 1 else ""
    if par.cp > 1:
        per_rank += (f"; per cp rank: 1/{par.cp} of the sequence plus each block's K/V {par.cp_rotate} at "
                     f"cluster.cp_bandwidth_gbs={cl.cp_bandwidth_gbs:g}")
    if par.ep > 1:
        per_rank += (f"; per ep rank: 1/{par.ep} of the experts, each MoE layer's all-to-alls at "
                     f"cluster.ep_bandwidth_gbs={cl.ep_bandwidth_gbs:g}"
                     + (" (hidden per layer in F&B pairs: pipeline.fb_overlap)" if plan.stage_costs.layers else ""))
    if plan.cost_source == "sleep":
        return "est. ms: the sleep model's configured times per layer" + per_rank
    if plan.cost_source == "analytic":
        return f"est. ms: one microbatch of {shape}, analytic FLOPs at sim.tflops={config.sim.tflops:g}" + per_rank
    return f"est. ms: one microbatch of {shape}, measured on {plan.cost_source.split(':', 1)[1]}" + per_rank


def sequence_and_expert_records(config: Config, plan: Plan) -> dict:
    """simulate.json's "context_parallel" and "expert_parallel" objects, where those are on: the degree, the
    link, and per microbatch the K/V exchange or all-to-all ms the stage costs above include."""
    par, cl, out = config.parallel, config.cluster, {}
    if par.cp > 1:
        out["context_parallel"] = {"cp": par.cp, "cp_rotate": par.cp_rotate,
                                   "cp_bandwidth_gbs": rounded(cl.cp_bandwidth_gbs)}
    if par.ep > 1:
        a2a = [(l.comm_f_ms, l.comm_b_ms) for l in plan.layer_costs]
        out["expert_parallel"] = {"ep": par.ep, "ep_bandwidth_gbs": rounded(cl.ep_bandwidth_gbs),
                                  "a2a_f_ms": rounded(sum(f for f, _ in a2a)),
                                 "a2a_b_ms": rounded(sum(b for _, b in a2a)),
                                  "fb_overlap_per_layer": bool(plan.stage_costs.layers)}
    return out


PROFILE_DIR = "profile"  # train/profiling.py's (which imports torch): profile/rank<r>.json in the run directory


def check_outputs(config: Config, run_dir: Optional[Path]) -> None:
    """Folders the ranks write into that a file already holds: one line now, not an error in every rank."""
    if run_dir is None:  # planned without a run directory (tests, the planner): nothing is written
        return
    prof = Path(run_dir) / PROFILE_DIR
    if (config.mode is Mode.train and config.profile.enabled
            and (prof.exists() or prof.is_symlink()) and not prof.is_dir()):
        raise ValueError(f"profile.enabled=true writes profile/rank<r>.json into {prof}, which is a file: move that "
                         f"file away, or set hydra.run.dir to another directory (or profile.enabled=false)")


def run_simulate(config: Config, run_dir: Path, console: Console | None = None) -> dict:
    """Simulate, print the partition, timeline and summary; write simulate.json, schedule_trace.json, schedule.csv."""
    with gc_paused():  # drawing and tracing 10^6 steps allocate like validating them (schedules/gc_pause.py)
        return plan_and_simulate(config, run_dir, console or Console(), timeline=config.sim.timeline)[1]


def plan_and_simulate(
    config: Config, run_dir: Path, console: Console, *, timeline: bool, write: bool = True
) -> tuple[Plan, dict]:
    """The checks every run does before any process starts: partition, validate, simulate, report."""
    check_outputs(config, run_dir)
    if config.partition.name == "profile":
        console.print(
            f"partition=profile: timing every layer of model={config.model.name} (cached after the first run)")
    plan = make_plan(config)
    result: SimResult = plan.simulated.result  # plan.py simulate_layout: the path the planner takes too
    record = render.result_record(
        result,
        schedule_name=plan.schedule.name,
        analytic_bubble=plan.analytic_bubble,
        param_copies=plan.schedule.placement.param_copies,
        virtual_stages=plan.schedule.placement.stages_per_rank,
    )
    record["partition"] = partition_record(plan.partition, model=config.model.name, cost_source=plan.cost_source)
    if plan.reduce_ms is not None:
        record["data_parallel"] = data_parallel_record(config, plan)
    if config.parallel.tp > 1:  # the stage costs above are one tp rank's (schedules/tp_cost.py)
        record["tensor_parallel"] = {"tp": config.parallel.tp, "sequence_parallel": config.parallel.sequence_parallel,
                                     "tp_bandwidth_gbs": rounded(config.cluster.tp_bandwidth_gbs)}
    record.update(sequence_and_expert_records(config, plan))
    part = plan.partition
    title = f"model={config.model.name} partition={part.strategy}: {part.num_layers} layers in {part.num_chunks} stages"
    if part.num_chunks <= MAX_TABLE_ROWS:
        table = partition_table(part, title=title)
        table.min_width = len(title)  # keep the title on one line above a narrow table
        print_table(console, table)
    else:
        console.print(f"{title}: {_too_many('stage', part.num_chunks)}; est. ms imbalance "
                      f"{100 * part.time_imbalance():.1f}%", highlight=False)
    console.print(_cost_note(config, plan), style="dim")
    apart = sorted(s for s in plan.compiled_stages if split_on(plan.schedule, [s]))
    if apart:  # parallel/parallelize.py apply_compile: the schedule, schedule.csv and the run say alike
        who = "every stage" if len(apart) == plan.schedule.placement.num_stages else "stages " + ", ".join(
            map(str, apart))
        console.print(f"trainer.compile: {who} keeps B and W apart (matrix-weight modules run eager, their "
                      f"weight-gradient GEMMs in W)", style="dim", highlight=False)
    layout = config.layout
    if layout.world > layout.pp and layout.world > MAX_TABLE_ROWS:
        console.print(f"ranks of {layout.describe()}: {_too_many('rank', layout.world)}", highlight=False)
    elif layout.world > layout.pp:
        pl = plan.schedule.placement
        print_table(console, rank_table(layout, [pl.stages_of(p) for p in range(layout.pp)]))
    if timeline:
        console.print(render.render_timeline(result, width=config.sim.timeline_width or None))
    print_table(console, render.summary_table([record]))
    if plan.reduce_ms is not None:
        console.print(_reduce_note(config, plan, result), highlight=False)
    if not write:
        return plan, record
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "simulate.json").write_text(json.dumps(record, indent=2) + "\n")
    (run_dir / "schedule_trace.json").write_text(json.dumps(render.chrome_trace(result)) + "\n")
    (run_dir / "schedule.csv").write_text(plan.schedule.to_csv())
    console.print(f"wrote {run_dir / 'simulate.json'}, schedule_trace.json (open in ui.perfetto.dev), schedule.csv")
    return plan, record
