"""Does a row the planner calls feasible stay under the memory cap when it runs? GPT-2 tiny and
Llama tiny on 2 CPU ranks, in fp32 and under bf16 autocast (issue 17: "no row predicted feasible
exceeds the cap when run").

1. `mode=plan partition=profile` (each layer's F, B, W and saved bytes measured here) over
   (1f1b, zbh1, zbv, gpipe) x microbatch size (1, 2, 4) x recompute (off, every layer) on pp2, with the
   default `plan.margin` and a cap (`--cap-gb`) that rules some rows out;
2. every feasible row trained for `--steps` steps through `pipetrain schedule=auto`, the plan group
   narrowed to that row (the planner's own path: the row's config comes from apply_row);
3. per row and rank: the measured peak (memory/peak_gb/rankR) against the cap, and against the
   prediction a CPU run can see (total minus the layer a backward recomputes, which only a GPU
   allocator's peak holds; tests/test_planner_e2e.py's cpu_counted_gb) with the margin left out.

Usage: python bench/planner_memory_cap.py [--cap-gb 0.035] [--steps 2] [--out FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from planner_accuracy import plan, train_row, write_result

RUNS = (("gpt2-tiny", "fp32"), ("llama-tiny", "fp32"), ("gpt2-tiny", "bf16"), ("llama-tiny", "bf16"))
SPACE = ["partition=profile", "plan.calibrate=false", "plan.pp=[2]", "plan.schedules=[1f1b,zbh1,zbv,gpipe]",
         "plan.microbatch_sizes=[1,2,4]", "plan.recompute=[false,true]", "plan.prune=false"]


def expected_gb(rank_memory: dict) -> float:
    """What the run's counted peak should be: the prediction without the margin and without the
    recomputing layer, the gradient copies and the loss's backward a CPU run does not see (and no per-GPU
    overhead)."""
    return (rank_memory["total_gb"] - rank_memory["margin_gb"] - rank_memory["recompute_gb"]
            - rank_memory.get("grad_copies_gb", 0.0) - rank_memory.get("loss_grad_gb", 0.0)
            - rank_memory.get("overhead_gb", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cap-gb", type=float, default=0.035, help="plan.memory_gb: per-rank budget")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_memory_cap.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pipetrain-plan-cap-"))
    os.environ.setdefault("PIPETRAIN_CACHE_DIR", str(work / "cache"))
    results = []
    for model, precision in RUNS:
        name = f"{model}_{precision}"
        base = [f"model={model}", f"trainer.precision={precision}", f"plan.memory_gb={args.cap_gb}", *SPACE]
        rows = plan(base, work, f"plan_{name}")["rows"]
        feasible = [r for r in rows if r["feasible"]]
        print(f"{model} {precision}: {len(rows)} rows, {len(feasible)} feasible under {args.cap_gb:g} GB", flush=True)
        for i, row in enumerate(feasible):
            one = [f"plan.schedules=[{row['schedule']}]", f"plan.microbatch_sizes=[{row['microbatch_size']}]",
                   f"plan.recompute=[{str(row['recompute']).lower()}]"]
            s = train_row(one, base, args.steps, work / f"{name}_{i}", work)
            got = s["plan_row"]
            assert (got["schedule"], got["microbatches"], got["recompute"]) == \
                (row["schedule"], row["microbatches"], row["recompute"]), (got, row)
            measured = [s[f"memory/peak_gb/rank{r}"] for r in range(len(got["memory_per_rank"]))]
            expected = [expected_gb(m) for m in got["memory_per_rank"]]
            errors = [m / e - 1 for m, e in zip(measured, expected)]
            results.append({"model": model, "precision": precision, "plan_rank": row["rank"],
                            "schedule": row["schedule"],
                            "microbatches": row["microbatches"], "microbatch_size": row["microbatch_size"],
                            "recompute": row["recompute"], "pred_peak_gb": row["pred_peak_gb"],
                            "expected_gb_per_rank": [round(e, 6) for e in expected],
                            "measured_gb_per_rank": [round(m, 6) for m in measured],
                            "errors": [round(e, 4) for e in errors], "under_cap": max(measured) <= args.cap_gb})
            r = results[-1]
            print(f"  #{r['plan_rank']:<3} {r['schedule']:>5} M={r['microbatches']:<3} mbs {r['microbatch_size']} "
                  f"recompute {'yes' if r['recompute'] else 'no ':3} predicted {r['pred_peak_gb']:.4f} GB (cap "
                  f"{args.cap_gb:g}); measured per rank {', '.join(f'{m:.4f}' for m in measured)} GB; error vs "
                  f"expected {', '.join(f'{100 * e:+.1f}%' for e in errors)}", flush=True)
        results.append({"model": model, "precision": precision, "rows": len(rows), "feasible": len(feasible),
                        "infeasible": len(rows) - len(feasible)})
    trained = [r for r in results if "schedule" in r]
    worst = max(abs(e) for r in trained for e in r["errors"])
    over = [r for r in trained if not r["under_cap"]]
    out = Path(args.out)
    write_result(out, {"cap_gb": args.cap_gb, "steps": args.steps, "space": SPACE, "note": args.note,
                       "trained_rows": len(trained), "rows_over_cap": len(over), "worst_abs_error": round(worst, 4),
                       "target_error": 0.10, "results": results})
    print(f"{len(trained)} feasible rows trained: {len(over)} over the {args.cap_gb:g} GB cap; worst per-rank "
          f"|measured / expected - 1| {100 * worst:.1f}% (target 10%); wrote {out}")


if __name__ == "__main__":
    main()
