"""How long generating + validating + simulating one schedule takes at P=32, M=256.

Target (issue 2): under one second for every schedule. Writes JSON (default
bench/results/simulate_speed.json). Usage: python bench/simulate_speed.py [--out FILE] [--P 32] [--M 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from pipetrain.schedules import registry
from pipetrain.schedules.simulate import StageCosts, simulate
from pipetrain.schedules.validate import validate

V = {"interleaved_1f1b": 2, "looped_bfs": 2}


def time_one(name: str, P: int, M: int, repeats: int) -> dict:
    v = V.get(name, registry.get(name).fixed_stages_per_rank or 1)
    best = {"generate_s": float("inf"), "validate_s": float("inf"), "simulate_s": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        sched = registry.build(name, P, M, v)
        t1 = time.perf_counter()
        validate(sched)
        t2 = time.perf_counter()
        res = simulate(sched, StageCosts.uniform(sched.placement.num_stages, 1.0, 1.0, 1.0), check=False)
        t3 = time.perf_counter()
        for k, dt in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
            best[k] = min(best[k], dt)
    steps = sum(len(r) for r in sched.steps)
    total = sum(best.values())
    return {"schedule": name, "degree": P, "microbatches": M, "virtual_stages": v, "steps": steps,
            **{k: round(x, 4) for k, x in best.items()}, "total_s": round(total, 4),
            "under_1s": total < 1.0, "bubble_fraction_mean": round(res.bubble_fraction_mean, 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--P", type=int, default=32)
    ap.add_argument("--M", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulate_speed.json"))
    args = ap.parse_args()
    rows = [time_one(n, args.P, args.M, args.repeats) for n in registry.names()]
    for r in rows:
        print(f"{r['schedule']:>18}  steps={r['steps']:>6}  total={r['total_s']:.3f}s  "
              f"(generate {r['generate_s']:.3f}, validate {r['validate_s']:.3f}, simulate {r['simulate_s']:.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                               "results": rows}, indent=2) + "\n")
    print(f"all under 1 s: {all(r['under_1s'] for r in rows)}; wrote {out}")


if __name__ == "__main__":
    main()
