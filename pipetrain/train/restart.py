"""A restarted worker group (launch.max_restarts, or torchrun --max-restarts): what happened before.

torch elastic restarts every worker when one dies (TORCHELASTIC_RESTART_COUNT counts the
restarts); the trainer then resumes from the newest verified checkpoint of the run directory by
itself (train/checkpoint.py: resume) and says, in one line on the console and in the loggers,

    restarted after rank 1 failed at step 8, resumed from step 5
    restarted after rank 3 (pp 1, dp_replicate 1) failed at step 8, resumed from step 5   (several pipelines)

Which rank failed: the previous attempt's error files (TORCHELASTIC_ERROR_FILE of each worker;
a rank that raised wrote one with its time, launch/errors.py: record_error). A rank killed by a
signal writes none: the rank without one failed; else the earliest error is the cause. At which
step: rank 0 keeps the step in progress in the agent's store (it outlives the workers), one small
write per step, only when restarts are possible.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from pipetrain.launch.env import STEP_FILE
from pipetrain.launch.errors import ENDED, rank_text
from pipetrain.config import Layout  # the run's parallel layout (parallel/layout.py)

_STEP_KEY = "pipetrain/step_in_progress"


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarts_possible() -> bool:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def _agent_store() -> Optional[dist.Store]:
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=60))


class StepTracker:
    """Rank 0, when restarts are possible: the step in progress, kept where it outlives the ranks: in
    torch elastic's agent store (torchrun), or in cluster=local's STEP_FILE (one small write per step)."""

    def __init__(self, rank: int) -> None:
        self.store = _agent_store() if rank == 0 and restarts_possible() else None
        self.file = os.environ.get(STEP_FILE) if self.store is None and restarts_possible() else None
        self.rank = rank

    def begin(self, step: int) -> None:
        if self.store is not None:
            self.store.set(_STEP_KEY, str(step))
        elif self.file and self.rank == 0:
            partial = f"{self.file}.partial"
            Path(partial).write_text(str(step))
            os.replace(partial, self.file)

    def last(self) -> Optional[int]:
        if self.store is not None:
            return int(self.store.get(_STEP_KEY).decode()) if self.store.check([_STEP_KEY]) else None
        try:
            return int(Path(self.file).read_text()) if self.file and self.rank == 0 else None
        except (OSError, ValueError):
            return None


def _error_times(attempt_dir: Path) -> dict[int, Optional[int]]:
    """Local rank -> the time_ns of its error file in one attempt's log folder (None: it left none)."""
    out: dict[int, Optional[int]] = {}
    for rank_dir in attempt_dir.iterdir() if attempt_dir.is_dir() else []:
        if not rank_dir.name.isdigit():
            continue
        try:
            extra = json.loads((rank_dir / "error.json").read_text())["message"]["extraInfo"]
            out[int(rank_dir.name)] = int(extra["time_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            out[int(rank_dir.name)] = None
    return out


def failed_rank(error_file: Optional[str] = None) -> Optional[int]:
    """The rank whose failure ended the previous attempt (None: unknown), from its log folder
    (<logs>/<run>/attempt_<n>/<local rank>/error.json; one node: local rank = rank)."""
    error_file = error_file or os.environ.get("TORCHELASTIC_ERROR_FILE")
    n = restart_count()
    if not error_file or n < 1:
        return None
    here = Path(error_file).parent.parent  # attempt_<n>
    attempt = here.with_name(f"attempt_{n - 1}")
    times = _error_times(attempt)
    try:  # cluster=local: the workers that had ended before the launcher stopped the others
        first = {int(r) for r in json.loads((attempt / ENDED).read_text())}
    except (OSError, ValueError, TypeError):
        first = set()
    silent = sorted((r for r, t in times.items() if t is None), key=lambda r: (r not in first, r))
    if silent:  # killed by a signal: no error file
        return silent[0]
    timed = {r: t for r, t in times.items() if t is not None}
    return min(timed, key=lambda r: (timed[r], r)) if timed else None


@dataclass(frozen=True)
class Restart:
    attempt: int  # 1 for the first restart
    rank: Optional[int]  # the global rank that failed, where known
    step: Optional[int]  # the step it failed in, where known
    layout: Optional[Layout] = None  # for that rank's pp / dp / tp coordinates

    def line(self, resumed_step: int) -> str:
        who = rank_text(self.rank, self.layout) if self.rank is not None else "a rank"
        when = f" at step {self.step}" if self.step is not None else ""
        return f"restarted after {who} failed{when}, resumed from step {resumed_step}"


def this_restart(tracker: StepTracker, layout: Optional[Layout] = None) -> Optional[Restart]:
    """Rank 0 of a restarted group: what happened (None when this is the first attempt)."""
    n = restart_count()
    if n < 1:
        return None
    return Restart(attempt=n, rank=failed_rank(), step=tracker.last(), layout=layout)
