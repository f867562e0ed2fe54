"""Start-up: what a run pays before and around its first step, by phase (issue #45's baseline).

Each case is a fresh process, run --rounds times, the cases interleaved (one of each per round, the
order rotated every round) so a slow moment on the machine falls on every case alike; the median
wall time of each is reported. Cases:
  import-cli          python -c "import pipetrain.cli"               (what every command pays)
  import-torch        python -c "import torch"
  import-rank         the fork server's preload (launch/forkserver.py PRELOAD: torch, torch.distributed,
                      the rank and trainer modules), on the critical path of a CPU run
  help                pipetrain --help                               (no torch: tests/test_startup.py)
  simulate-sleep      pipetrain mode=simulate model=sleep            (no torch)
  quickstart-1-step   pipetrain trainer.max_steps=1                  (the README's run, one step)
`pipetrain` is run as its console script runs it: the entry point the measured tree's pyproject.toml
declares ([project.scripts]), called from `python -c`, so each tree starts the way a user's does.
The quickstart's own step (its `perf/step_time_s`, from metrics.jsonl) is reported beside it, so
start-up = wall - step. `--old REV` adds the quickstart of commit REV (`git archive` into a temporary
directory, run with PYTHONPATH there and its own conf/), interleaved with the others every round, and
writes its median and new / old. Run from the repository root:

    python bench/startup.py --rounds 5 --old 1875543

Writes bench/results/startup.json (paths relative to the repository). Every case runs with PYTHONPATH
at the tree it measures, so an installed pipetrain elsewhere is not what is timed; the configs must
be that tree's too (the script checks: a worktree whose editable install points at another checkout
gets `pipetrain/conf` and `pipetrain/recipes` links to ../conf and ../recipes, left uncommitted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PIPETRAIN = "<pipetrain>"  # the tree's console script (script())
CASES = {
    "import-cli": [PY, "-c", "import pipetrain.cli"],
    "import-torch": [PY, "-c", "import torch"],
    "import-rank": [PY, "-c", "import torch, torch.distributed, pipetrain.launch.rank, pipetrain.train.trainer"],
    "help": [PIPETRAIN, "--help"],
    "simulate-sleep": [PIPETRAIN, "mode=simulate", "model=sleep"],
    "quickstart-1-step": [PIPETRAIN, "trainer.max_steps=1", "logger=[console,jsonl]"],
}


def script(tree: Path) -> list[str]:
    """What the `pipetrain` console script of `tree` runs: its [project.scripts] entry point."""
    import tomllib

    target = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["pipetrain"]
    module, _, function = target.split("#")[0].strip().partition(":")
    return [PY, "-c", f"import sys; sys.argv[0] = 'pipetrain'; from {module} import {function}; sys.exit({function}())"]


OLD = "quickstart-1-step@old"


def checkout(rev: str, into: Path) -> Path:
    """Commit `rev`'s tree under `into` (git archive: the repository is only read), with the package
    links to its own conf/ and recipes/ that an installed wheel would carry."""
    tree = into / f"old-{rev}"
    tree.mkdir()
    with subprocess.Popen(["git", "archive", rev], cwd=REPO, stdout=subprocess.PIPE) as git:
        with tarfile.open(fileobj=git.stdout, mode="r|") as tar:
            tar.extractall(tree, filter="data")
    if git.returncode:
        raise SystemExit(f"git archive {rev} failed ({git.returncode})")
    for name in ("conf", "recipes"):
        if not (tree / "pipetrain" / name).exists():
            (tree / "pipetrain" / name).symlink_to(Path("..") / name)
    return tree


def check_tree(tree: Path) -> None:
    """The configs a run under PYTHONPATH=tree composes are that tree's own."""
    code = "from importlib import resources; print(resources.files('pipetrain.conf'))"
    found = subprocess.run([PY, "-c", code], env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True,
                           text=True).stdout.strip()
    if Path(found).resolve() != (tree / "conf").resolve():
        raise SystemExit(f"under PYTHONPATH={tree} pipetrain composes {found}, not {tree / 'conf'}: link "
                         f"pipetrain/conf -> ../conf and pipetrain/recipes -> ../recipes there (uncommitted)")


def run(name: str, cmd: list[str], where: Path, tree: Path = REPO) -> tuple[float, float | None]:
    """(wall seconds, the run's own step seconds where it trained) of one fresh process, pipetrain from `tree`."""
    run_dir = where / f"{name}-{time.monotonic_ns()}"
    args = cmd + ([f"hydra.run.dir={run_dir}"] if cmd[0] == PIPETRAIN and "--help" not in cmd else [])
    args = [*script(tree), *args[1:]] if cmd[0] == PIPETRAIN else args
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(tree))
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
    ap.add_argument("--old", metavar="REV", help="also time the quickstart of this commit (e.g. 1875543)")
    a = ap.parse_args()
    check_tree(REPO)
    names = list(CASES) + ([OLD] if a.old else [])
    walls: dict[str, list[float]] = {n: [] for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = checkout(a.old, Path(tmp)) if a.old else None
        if old_tree is not None:
            check_tree(old_tree)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name == OLD:
                    wall, step = run(name, CASES["quickstart-1-step"], Path(tmp), old_tree)
                else:
                    wall, step = run(name, CASES[name], Path(tmp))
                walls[name].append(wall)
                if step is not None:
                    steps[name].append(step)
    new_s = statistics.median(walls["quickstart-1-step"])
    result = {
        "what": "median wall seconds of each case, fresh processes, interleaved rounds",
        "rounds": a.rounds, "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "median_s": {n: round(statistics.median(v), 3) for n, v in walls.items()},
        "all_s": {n: [round(x, 3) for x in v] for n, v in walls.items()},
        "quickstart_step_s": round(statistics.median(steps["quickstart-1-step"]), 3),
        "commands": {n: " ".join("pipetrain" if c == PIPETRAIN else Path(c).name if i == 0 else c
                                 for i, c in enumerate(cmd)) for n, cmd in CASES.items()},
    }
    if a.old:
        old_s = statistics.median(walls[OLD])
        result["old"] = {
            "rev": subprocess.run(["git", "rev-parse", "--short", a.old], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip(),
            "what": "the same quickstart command run from `git archive REV` (PYTHONPATH there), interleaved",
            "quickstart_1_step_s": round(old_s, 3), "quickstart_step_s": round(statistics.median(steps[OLD]), 3),
        }
        result["new_over_old"] = round(new_s / old_s, 3)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    for n, v in result["median_s"].items():
        print(f"{n:20s} {v:6.2f} s")
    print(f"quickstart step       {result['quickstart_step_s']} s  -> {os.path.relpath(a.out, REPO)}")
    if a.old:
        print(f"new / old ({result['old']['rev']}) 1-step quickstart: {result['new_over_old']}")


if __name__ == "__main__":
    main()
