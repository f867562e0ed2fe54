"""Zero bubble under trainer.compile: compiled ZB-V against compiled 1F1B, measured and simulated.

For llama-tiny and moe-tiny at P = 2 and 4 (one spawn of P gloo ranks per model and P), four trainers
are built side by side in one process group: ZB-V and 1F1B, each compiled and eager. After one
untimed step each (compilation), `--rounds` interleaved rounds measure one step of each in turn (the
machine's load falls on all four alike). Per case (medians over the rounds):

  step_ms             the measured step (makespan on the common time axis, metrics/measure.py)
  bubble, bubble_sim  the measured bubble and the simulator's for the same step's measured op costs
  sim_ms              the simulator's makespan for those costs
Per model and P:
  zbv_over_1f1b       compiled ZB-V's step over compiled 1F1B's, measured, and the simulation's ratio
                      (each schedule simulated with its own measured op costs), and the plan's (both
                      schedules simulated from the same formula layer costs, mode=simulate's numbers)
  per_stage           ZB-V's F + B + W of one microbatch per stage, eager and compiled
Targets (issue 49): compiled ZB-V's measured bubble within 0.03 of its simulated one; compiled ZB-V at
least as fast as compiled 1F1B where the simulation says it should be.

Usage: python bench/compile_zb.py [--rounds 5] [--out bench/results/compile_zb.json]
A few minutes on 2 quiet cores; Inductor's cache (/tmp/torchinductor_$USER) makes a second run faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from pipetrain.compose import compose_config
from pipetrain.launch.local import spawn_local
from pipetrain.plan import make_plan

BASE = ["mode=train", "data=synthetic", "data.seq_len=64", "trainer.device=cpu", "trainer.eval_every=0",
        "trainer.ckpt_at_end=false", "trainer.ckpt_every=0", "logger=[]",
        # a compiled MoE block recompiles for new expert counts in later steps too: slow, not stuck, on a loaded box
        "pipeline.p2p_timeout_s=900"]
CASES = [(s, c) for c in (True, False) for s in ("zbv", "1f1b")]
BUBBLE_TOL = 0.03


def case_name(schedule: str, compiled: bool) -> str:
    return f"{schedule}_{'compiled' if compiled else 'eager'}"


def configs(model: str, ranks: int) -> dict:
    m = 4 * ranks  # microbatches: ZB-V's steady state at either P
    return {case_name(s, c): compose_config([*BASE, f"model={model}", f"pipeline.degree={ranks}",
                                             f"pipeline.microbatches={m}", f"data.batch_size={2 * m}",
                                             f"schedule={s}", f"trainer.compile={str(c).lower()}"])
            for s, c in CASES}


def rank_main(rank: int, world: int, out: Path, cases: dict, rounds: int) -> None:
    from pipetrain.train.trainer import Trainer

    trainers = {name: Trainer(config, plan, out / name) for name, (config, plan) in cases.items()}
    for t in trainers.values():  # compilation and the first step's warm-up, untimed
        t.train_step()
    rows: dict[str, list] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, t in trainers.items():
            m = t.train_step(measure=True).measurement
            if m is not None:
                costs = m.simulated.costs
                rows[name].append({"step_ms": m.makespan_ms, "bubble": m.bubble_mean,
                                   "bubble_sim": m.simulated.bubble_fraction_mean, "sim_ms": m.simulated.makespan,
                                   "stage_ms": [f + b + w for f, b, w in zip(costs.f, costs.b, costs.w)]})
    if rank == 0:
        torch.save(rows, out / "rows.pt")


def median_row(rows: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_ms", "bubble", "bubble_sim", "sim_ms")}
    med["stage_ms"] = [statistics.median(r["stage_ms"][s] for r in rows) for s in range(len(rows[0]["stage_ms"]))]
    return med


def bench(model: str, ranks: int, rounds: int, root: Path) -> dict:
    cfgs = configs(model, ranks)
    plans = {name: make_plan(c) for name, c in cfgs.items()}
    work = root / f"{model}_p{ranks}"
    spawn_local(rank_main, ranks, work, {n: (cfgs[n], plans[n]) for n in cfgs}, rounds)
    med = {name: median_row(rows) for name, rows in torch.load(work / "rows.pt").items()}
    zc, oc = med["zbv_compiled"], med["1f1b_compiled"]
    plan_ratio = plans["zbv_compiled"].simulated.result.makespan / plans["1f1b_compiled"].simulated.result.makespan
    return {
        "model": model, "P": ranks, "M": cfgs["zbv_compiled"].pipeline.microbatches, "rounds": rounds,
        "cases": {name: {k: (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v])
                         for k, v in row.items()} for name, row in med.items()},
        "zbv_over_1f1b": {"measured": round(zc["step_ms"] / oc["step_ms"], 3),
                          "simulated": round(zc["sim_ms"] / oc["sim_ms"], 3), "plan": round(plan_ratio, 3)},
        "zbv_bubble_gap": round(abs(zc["bubble"] - zc["bubble_sim"]), 4),
        "per_stage": [{"stage": s, "eager_ms": round(e, 3), "compiled_ms": round(c, 3)}
                      for s, (e, c) in enumerate(zip(med["zbv_eager"]["stage_ms"], zc["stage_ms"]))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["llama-tiny", "moe-tiny"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_zb.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for m, p in [(m, p) for m in args.models for p in args.ranks]:  # each row written as it comes
            try:
                rows.append(bench(m, p, args.rounds, Path(tmp)))
            except Exception as e:  # a failed case is a row saying why; the others still run
                rows.append({"model": m, "P": p, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
            write(args.out, rows)
    for r in rows:
        if "error" in r:
            print(f"{r['model']:10s} P={r['P']} failed: {r['error']}")
            continue
        z = r["cases"]["zbv_compiled"]
        ratio = r["zbv_over_1f1b"]
        ok = "ok" if r["zbv_bubble_gap"] <= BUBBLE_TOL else "OVER"
        print(f"{r['model']:10s} P={r['P']} compiled zbv/1f1b measured {ratio['measured']:.3f} simulated "
              f"{ratio['simulated']:.3f} plan {ratio['plan']:.3f}; zbv bubble {z['bubble']:.3f} sim "
              f"{z['bubble_sim']:.3f} gap {r['zbv_bubble_gap']:.3f} {ok}")


def write(path: str, rows: list[dict]) -> None:
    out = {"bench": "compile_zb", "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
           "load_avg_1m": round(os.getloadavg()[0], 2), "target": {"bubble_gap": BUBBLE_TOL}, "rows": rows}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
