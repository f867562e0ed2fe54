"""Does the planner predict what runs? The sleep model on 4 CPU ranks, a sweep of
(schedule, M, pp x dp) under a memory cap that rules the pp=1 layouts out (8 layers of 250k fp32 weights: 32 MB of
weights, gradients and AdamW state on one rank, against a 25 MB cap).

1. `mode=plan` over the sweep (plan.json: every row, feasible or why not);
2. the top `--runs` feasible rows each trained for real through `pipetrain schedule=auto` with the
   plan group narrowed to that row (so the run takes the planner's own path), a few steps each;
3. per row: predicted step time (summary.json's plan_pred_step_ms) vs measured (measured_step_ms,
   the median after the first step), and whether the measured best is the plan's first row or
   within 3% of it. Targets (issue 17): every row within 5%; best within 3%.

The sleep layers sleep their configured times, so 4 ranks share a 2-core machine without competing
for compute; what the model does not know is the executor's own overhead and gloo's message latency.

Usage: python bench/planner_accuracy.py [--layer-ms 10] [--runs 8] [--steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SWEEP = ["model=sleep", "model.layers=8", "model.params_per_layer=250000", "plan.world_size=4", "data.batch_size=16",
         "plan.schedules=[1f1b,zbh1,zbv,zb_auto]", "plan.microbatch_sizes=[1,2]", "plan.memory_gb=0.025",
         "plan.prune=false", "plan.dp_gbs=0.7"]  # gloo all-reduce as bench/data_parallel_reduce.py measured it


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layer-ms", type=float, default=10.0, help="F, B and W of one sleep layer")
    ap.add_argument("--runs", type=int, default=8, help="feasible rows to train (best first)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_accuracy.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pipetrain-plan-bench-"))
    times = [f"model.f_ms={args.layer_ms}", f"model.b_ms={args.layer_ms}", f"model.w_ms={args.layer_ms}"]
    res = cli(["mode=plan", *SWEEP, *times, f"hydra.run.dir={work / 'plan'}"], work)
    if res.returncode:
        raise SystemExit(res.stderr)
    plan = json.loads((work / "plan" / "plan.json").read_text())
    feasible = [r for r in plan["rows"] if r["feasible"]]
    print(f"{len(plan['rows'])} rows, {len(feasible)} feasible under {plan['memory_gb']} GB", flush=True)
    measured = []
    for i, row in enumerate(feasible[: args.runs]):
        one = [f"plan.schedules=[{row['schedule']}]", f"plan.pp=[{row['pp']}]",
               f"plan.microbatch_sizes=[{row['microbatch_size']}]", f"plan.virtual_stages=[{max(row['v'], 2)}]"]
        run_dir = work / f"run{i}"
        res = cli(["schedule=auto", *SWEEP, *times, *one, f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                   "trainer.ckpt_at_end=false", "logger=[console]", f"hydra.run.dir={run_dir}"], work)
        if res.returncode:
            raise SystemExit(f"row {i + 1} failed: {res.stderr[-2000:]}")
        s = json.loads((run_dir / "summary.json").read_text())
        got = s["plan_row"]
        assert (got["schedule"], got["pp"], got["microbatches"]) == (row["schedule"], row["pp"], row["microbatches"])
        measured.append({"plan_rank": row["rank"], "schedule": row["schedule"], "pp": row["pp"], "dp": row["dp"],
                         "v": row["v"], "microbatches": row["microbatches"], "microbatch_size": row["microbatch_size"],
                         "pred_step_ms": round(s["plan_pred_step_ms"], 2), "measured_step_ms": round(s["measured_step_ms"], 2),
                         "error": round(s["step_time_error"], 4), "pred_peak_gb": row["pred_peak_gb"]})
        m = measured[-1]
        print(f"#{m['plan_rank']:<3} pp{m['pp']} x dp{m['dp']} {m['schedule']:>8} M={m['microbatches']:<3} "
              f"predicted {m['pred_step_ms']:8.1f} ms  measured {m['measured_step_ms']:8.1f} ms  "
              f"error {100 * m['error']:+.1f}%", flush=True)
    best = min(measured, key=lambda m: m["measured_step_ms"])
    first = measured[0]
    gap = first["measured_step_ms"] / best["measured_step_ms"] - 1
    worst = max(abs(m["error"]) for m in measured)
    out = Path(args.out)
    out.write_text(json.dumps({
        "layer_ms": args.layer_ms, "steps": args.steps, "sweep": SWEEP, "python": platform.python_version(),
        "cpus": os.cpu_count(), "note": "measured on a shared 2-core machine while other jobs ran",
        "rows": len(plan["rows"]), "feasible": len(feasible),
        "infeasible_reasons": sorted({r["reason"].split(" by ")[0] for r in plan["rows"] if not r["feasible"]}),
        "worst_abs_error": worst, "target_error": 0.05, "measured_best_plan_rank": best["plan_rank"],
        "plan_first_vs_measured_best": round(gap, 4), "target_best_gap": 0.03, "measured": measured,
    }, indent=2) + "\n")
    print(f"worst |error| {100 * worst:.1f}% (target 5%); measured best is plan row #{best['plan_rank']}, "
          f"plan's first row {100 * gap:+.1f}% slower than it (target 3%); wrote {out}")


if __name__ == "__main__":
    main()
