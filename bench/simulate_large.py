"""How `mode=simulate` scales in P and M: the command a user types, timed end to end.

Issue 25: at P=10000, M=64 it took 309 s (45 s in round 1); target under 60 s. Each point runs
`pipetrain mode=simulate model=sleep model.layers=P pipeline.degree=P pipeline.microbatches=M`
(1f1b, the defaults) in a fresh process, output to a file, and records wall and CPU seconds
(CPU: the machine is shared, wall is not). Writes JSON (default bench/results/simulate_large.json).
Usage: python bench/simulate_large.py [--out FILE] [--points 1000x64,10000x64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POINTS = ((1000, 64), (2000, 64), (4000, 64), (10000, 64), (1000, 128), (1000, 256))


def time_one(P: int, M: int, tmp: Path) -> dict:
    run_dir = tmp / f"p{P}_m{M}"
    cmd = [sys.executable, "-m", "pipetrain.cli", "mode=simulate", "model=sleep", f"model.layers={P}",
           f"pipeline.degree={P}", f"pipeline.microbatches={M}", f"hydra.run.dir={run_dir}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(tmp / f"p{P}_m{M}.out", "w") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, env={**os.environ, "COLUMNS": "120"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"degree": P, "microbatches": M, "steps": 2 * P * M, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "cpu_us_per_step": round(1e6 * cpu / (2 * P * M), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--points", default=",".join(f"{p}x{m}" for p, m in POINTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulate_large.json"))
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for P, M in points:
            rows.append(time_one(P, M, Path(tmp)))
            r = rows[-1]
            print(f"P={P:>6} M={M:>4} steps={r['steps']:>8}  wall {r['wall_s']:7.2f} s  cpu {r['cpu_s']:7.2f} s  "
                  f"({r['cpu_us_per_step']} us/step)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                               "cpus": os.cpu_count(), "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
