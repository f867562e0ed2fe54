"""`pipetrain` run many times, cheaply: `python tests/_cli_runs.py ROOT N OVERRIDE...` runs the console
script's entry (pipetrain.cli:main) N times with these overrides and hydra.run.dir=ROOT/run<i>, each in a
process of its own whose stdout and stderr are the files ROOT/stdout<i> and ROOT/stderr<i>, and prints
their exit codes as a JSON list.

Each run is a process forked from this one, which has imported what the command imports (torch, Hydra, the
planner) and registered its configs: a run then costs its own work (~1 s: three composes and the plan) and
not ~2 s of start-up besides, and still ends as the command does (sys.exit out of main, the console tee
joined, the interpreter's teardown). Two run at a time, as on the 2-core machine the suite is sized for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401 - imported by the command (execution.py: run_device); here once, for every run

import pipetrain.planner.auto  # schedule=auto's planner, imported inside run()
import pipetrain.simulate_cmd  # noqa: F401
from pipetrain.cli import main
from pipetrain.compose import register_all

AT_ONCE = 2


def _run(root: Path, i: int, overrides: list[str]) -> None:
    """In the forked process: run i, its fds 1 and 2 on its files; it never returns (main's sys.exit, or ours)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(root / f"{name}{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["pipetrain", *overrides, f"hydra.run.dir={root / f'run{i}'}"]
    main()
    sys.exit(0)


def run_all(root: Path, n: int, overrides: list[str]) -> list[int]:
    register_all()  # main's first step, cached: done once here
    codes: dict[int, int] = {}
    running: dict[int, int] = {}  # pid -> run
    for i in range(n):
        while len(running) >= AT_ONCE:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        pid = os.fork()
        if pid == 0:
            _run(root, i, overrides)
        running[pid] = i
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    return [codes[i] for i in range(n)]


if __name__ == "__main__":
    print(json.dumps(run_all(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])))
