"""Start-up: what a run pays before and around its first step, by phase (issue #45's baseline).

Each case is a fresh process, run --rounds times, the cases interleaved (one of each per round, the
order rotated every round) so a slow moment on the machine falls on every case alike; the median
wall time of each is reported. Cases:
  import-cli          python -c "import pipetrain.cli"               (what every command pays)
  import-torch        python -c "import torch"
  import-rank         torch, torch.distributed, torch._dynamo: the fork server's preload
                      (launch/forkserver.py PRELOAD), on the critical path of a CPU run
  help                pipetrain --help                               (no torch: tests/test_startup.py)
  simulate-sleep      pipetrain mode=simulate model=sleep            (no torch)
  quickstart-1-step   pipetrain trainer.max_steps=1                  (the README's run, one step)
The quickstart's own step (its `perf/step_time_s`, from metrics.jsonl) is reported beside it, so
start-up = wall - step. Run from the repository root:

    python bench/startup.py --rounds 5

Writes bench/results/startup.json (paths relative to the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CASES = {
    "import-cli": [PY, "-c", "import pipetrain.cli"],
    "import-torch": [PY, "-c", "import torch"],
    "import-rank": [PY, "-c", "import torch, torch.distributed, torch._dynamo"],
    "help": [PY, "-m", "pipetrain.cli", "--help"],
    "simulate-sleep": [PY, "-m", "pipetrain.cli", "mode=simulate", "model=sleep"],
    "quickstart-1-step": [PY, "-m", "pipetrain.cli", "trainer.max_steps=1", "logger=[console,jsonl]"],
}


def run(name: str, cmd: list[str], where: Path) -> tuple[float, float | None]:
    """(wall seconds, the run's own step seconds where it trained) of one fresh process."""
    run_dir = where / f"{name}-{time.monotonic_ns()}"
    args = cmd + ([f"hydra.run.dir={run_dir}"] if cmd[1:3] == ["-m", "pipetrain.cli"] and "--help" not in cmd else [])
    env = dict(os.environ, WANDB_MODE="offline")
    t0 = time.perf_counter()
    res = subprocess.run(args, cwd=where, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}): {res.stderr[-500:]}")
    metrics = run_dir / "metrics.jsonl"
    step = json.loads(metrics.read_text().splitlines()[-1])["perf/step_time_s"] if metrics.exists() else None
    return wall, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "startup.json"))
    a = ap.parse_args()
    names = list(CASES)
    walls: dict[str, list[float]] = {n: [] for n in names}
    steps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                wall, step = run(name, CASES[name], Path(tmp))
                walls[name].append(wall)
                if step is not None:
                    steps.append(step)
    result = {
        "what": "median wall seconds of each case, fresh processes, interleaved rounds",
        "rounds": a.rounds, "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "median_s": {n: round(statistics.median(v), 3) for n, v in walls.items()},
        "all_s": {n: [round(x, 3) for x in v] for n, v in walls.items()},
        "quickstart_step_s": round(statistics.median(steps), 3) if steps else None,
        "commands": {n: " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd)) for n, cmd in CASES.items()},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    for n, v in result["median_s"].items():
        print(f"{n:20s} {v:6.2f} s")
    print(f"quickstart step       {result['quickstart_step_s']} s  -> {os.path.relpath(a.out, REPO)}")


if __name__ == "__main__":
    main()
