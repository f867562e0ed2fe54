"""Does the planner predict what runs? The sleep model on 4 CPU ranks, a sweep of
(schedule, M, pp x dp) under a memory cap that rules the pp=1 layouts out (8 layers of 250k fp32 weights: 32 MB of
weights, gradients and AdamW state on one rank, against a 25 MB cap).

1. `mode=plan` over the sweep (plan.json: every row, feasible or why not);
2. every feasible row (or the top `--runs`) each trained for real through `pipetrain schedule=auto` with the
   plan group narrowed to that row (so the run takes the planner's own path), a few steps each;
3. per row: predicted step time (summary.json's plan_pred_step_ms) vs measured (measured_step_ms,
   the median after the first step), and whether the measured best is the plan's first row or
   within 3% of it. Targets (issue 17): every row within 5%; best within 3%.

The sweep is planned with `plan.calibrate=true`: before it, two short runs (zbh1 and zbv, pp2 x dp2, metrics
every step; pipetrain/planner/measure.py) measure what the model does not know: the executor's time per
action and per layer beyond the sleeps, gloo's fixed cost per gradient reduction, and the step's cost
outside the pipeline. Each row is trained with those overheads (plan.action_overhead_ms, plan.layer_overhead_ms,
plan.reduce_latency_ms, plan.step_overhead_ms, from plan.json's `calibration`) and also records the
uncalibrated prediction and its error.
Rows are interleaved over `--rounds` (every row once per round) and each row's measured step time is
the median over rounds, so a burst of load on a shared machine does not land on one row only.

Usage: python bench/planner_accuracy.py [--layer-ms 10] [--runs 0] [--steps 6] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SWEEP = ["model=sleep", "model.layers=8", "model.params_per_layer=250000", "plan.world_size=4", "data.batch_size=16",
         "plan.schedules=[1f1b,zbh1,zbv,zb_auto]", "plan.microbatch_sizes=[1,2]", "plan.memory_gb=0.025",
         "plan.prune=false",
         "cluster.dp_bandwidth_gbs=0.7"]  # gloo all-reduce as bench/data_parallel_reduce.py measured it


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


KEY = ("schedule", "pp", "dp", "v", "microbatches", "microbatch_size")


def train_row(one: list[str], base: list[str], steps: int, run_dir: Path, work: Path) -> dict:
    """`schedule=auto` narrowed to one row; its summary.json."""
    res = cli(["schedule=auto", *base, *one, f"trainer.max_steps={steps}", "trainer.eval_every=0",
               "trainer.ckpt_at_end=false", "logger=[console,jsonl]", f"hydra.run.dir={run_dir}"], work)
    if res.returncode:
        raise SystemExit(f"{run_dir.name} failed: {res.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def write_result(out: Path, fields: dict) -> None:
    """A planner bench's JSON: its fields and the machine it ran on."""
    out.write_text(json.dumps({**fields, "python": platform.python_version(), "cpus": os.cpu_count()}, indent=2) + "\n")


def plan(args: list[str], work: Path, name: str) -> dict:
    res = cli(["mode=plan", *args, f"hydra.run.dir={work / name}"], work)
    if res.returncode:
        raise SystemExit(res.stderr)
    return json.loads((work / name / "plan.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layer-ms", type=float, default=10.0, help="F, B and W of one sleep layer")
    ap.add_argument("--runs", type=int, default=0,
                    help="feasible rows to train, best first (0: every feasible row, as issue 17 asks)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="times each row is trained, interleaved; the median counts")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_accuracy.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. how loaded the machine was)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pipetrain-plan-bench-"))
    times = [f"model.f_ms={args.layer_ms}", f"model.b_ms={args.layer_ms}", f"model.w_ms={args.layer_ms}"]
    base = [*SWEEP, *times]  # mode=plan: uncalibrated unless asked
    raw = {tuple(r[k] for k in KEY): r for r in plan(base, work, "plan_uncalibrated")["rows"]}
    planned = plan([*base, "plan.calibrate=true", f"plan.calibrate_steps={args.steps}"], work, "plan")
    cal, rows = planned["calibration"], planned["rows"]
    print(f"calibration: {cal}", flush=True)
    calibrated = [*base, *(f"plan.{k}={v}" for k, v in cal.items()), "plan.calibrate=false"]  # measured once
    feasible = [r for r in rows if r["feasible"]]
    print(f"{len(rows)} rows, {len(feasible)} feasible under the memory cap", flush=True)
    chosen = feasible[: args.runs] if args.runs > 0 else feasible
    runs: list[list[dict]] = [[] for _ in chosen]
    for rnd in range(args.rounds):
        for i, row in enumerate(chosen):
            one = [f"plan.schedules=[{row['schedule']}]", f"plan.pp=[{row['pp']}]",
                   f"plan.microbatch_sizes=[{row['microbatch_size']}]", f"plan.virtual_stages=[{max(row['v'], 2)}]"]
            s = train_row(one, calibrated, args.steps, work / f"run{i}_{rnd}", work)
            got = s["plan_row"]
            assert ((got["schedule"], got["pp"], got["microbatches"])
                    == (row["schedule"], row["pp"], row["microbatches"]))
            runs[i].append(s)
            print(f"round {rnd + 1} #{row['rank']:<3} pp{row['pp']} x dp{row['dp']} {row['schedule']:>8} "
                  f"M={row['microbatches']:<3} predicted {s['plan_pred_step_ms']:8.1f} ms  measured "
                  f"{s['measured_step_ms']:8.1f} ms", flush=True)
    measured = []
    for row, ss in zip(chosen, runs):
        ms = statistics.median(s["measured_step_ms"] for s in ss)
        before = raw[tuple(row[k] for k in KEY)]["pred_step_ms"]
        measured.append({"plan_rank": row["rank"], "schedule": row["schedule"], "pp": row["pp"], "dp": row["dp"],
                         "v": row["v"], "microbatches": row["microbatches"], "microbatch_size": row["microbatch_size"],
                         "pred_step_ms": round(row["pred_step_ms"], 2), "measured_step_ms": round(ms, 2),
                         "error": round(ms / row["pred_step_ms"] - 1, 4), "pred_peak_gb": row["pred_peak_gb"],
                         "pred_step_ms_uncalibrated": round(before, 2), "error_uncalibrated": round(ms / before - 1, 4),
                         "measured_step_ms_rounds": [round(s["measured_step_ms"], 2) for s in ss]})
        m = measured[-1]
        print(f"#{m['plan_rank']:<3} pp{m['pp']} x dp{m['dp']} {m['schedule']:>8} M={m['microbatches']:<3} "
              f"predicted {m['pred_step_ms']:8.1f} ms  measured {m['measured_step_ms']:8.1f} ms  "
              f"error {100 * m['error']:+.1f}% (uncalibrated {100 * m['error_uncalibrated']:+.1f}%)", flush=True)
    best = min(measured, key=lambda m: m["measured_step_ms"])
    first = measured[0]
    gap = first["measured_step_ms"] / best["measured_step_ms"] - 1
    worst = max(abs(m["error"]) for m in measured)
    out = Path(args.out)
    write_result(out, {
        "layer_ms": args.layer_ms, "steps": args.steps, "rounds": args.rounds, "sweep": SWEEP,
        "note": args.note, "calibration": cal,
        "rows": len(rows), "feasible": len(feasible),
        "infeasible_reasons": sorted({r["reason"].split(" by ")[0] for r in rows if not r["feasible"]}),
        "worst_abs_error": worst, "worst_abs_error_uncalibrated": max(abs(m["error_uncalibrated"]) for m in measured),
        "target_error": 0.05, "measured_best_plan_rank": best["plan_rank"],
        "plan_first_vs_measured_best": round(gap, 4), "target_best_gap": 0.03, "measured": measured,
    })
    print(f"worst |error| {100 * worst:.1f}% (target 5%); measured best is plan row #{best['plan_rank']}, "
          f"plan's first row {100 * gap:+.1f}% slower than it (target 3%); wrote {out}")


if __name__ == "__main__":
    main()
