"""Stopping on a signal without losing the step: SIGTERM (SLURM's preemption, the elastic agent
shutting its workers down), SIGINT (Ctrl-C) and, under submitit, SIGUSR2 (its preemption /
time-out signal).

The handler only raises a flag: the rank finishes the step it is in (a pipeline step half done
on one rank and abandoned on another would deadlock the peers). After every step the ranks agree
(one all-reduce of a flag: a signal seen by any rank stops all) and then stop together, after a
checkpoint of that step; the trainer says where to resume. Under submitit its own SIGUSR2
handler runs after the save (on rank 0 it requeues the job, which resumes with trainer.resume=auto).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from pipetrain.launch.errors import RANKS, STOPPED, UNFINISHED, record_error



class StopSignals:
    """A context manager: while inside, SIGTERM / SIGINT (and SIGUSR2 when a handler, submitit's,
    was installed before) only set `signum`."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.previous: dict[int, Any] = {}
        # How long the step in flight may take to reach its end once a signal came (the trainer
        # sets it from the steps so far). A rank that does not get there (a peer died: torch
        # elastic stops the survivors with SIGTERM before a restart) leaves, instead of holding
        # the restart up until the agent's 30 s kill.
        self.grace_s = 10.0
        self._watchdog: Optional[threading.Timer] = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            self._watchdog = threading.Timer(self.grace_s, _leave, args=(signum,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach only the main thread: nothing to install
        wanted = [signal.SIGTERM, signal.SIGINT]
        if callable(signal.getsignal(signal.SIGUSR2)):  # submitit's preemption handler
            wanted.append(signal.SIGUSR2)
        for sig in wanted:
            self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous.clear()

    def agreed(self, device: torch.device) -> Optional[int]:
        """Collective (every rank, after every step): the signal any rank received, or None."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and self._watchdog is not None:  # every rank reached the step's end: save in peace
            self._watchdog.cancel()
        return signum or None

    def chain(self, signum: int) -> None:
        """After the save: the handler that was there before ours (submitit's requeue), if any."""
        old = self.previous.get(signum)
        if callable(old):
            self.__exit__()
            old(signum, None)


def _leave(signum: int) -> None:
    """The step in flight did not end within the grace time after a signal: leave as the signal would have."""
    import sys

    message = f"{signal_name(signum)}: {UNFINISHED}; leaving without a checkpoint"
    print(message, file=sys.stderr, flush=True)
    record_error(RuntimeError(message))  # an error file of its own: a rank that left none was killed
    os._exit(128 + signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def hold_presence(run_dir: Path) -> None:
    """In a rank: hold a shared lock on <run_dir>/.ranks until this process ends (no fd is returned:
    it stays open on purpose). Best effort: a run directory this rank cannot write only loses the wait."""
    try:
        fd = os.open(Path(run_dir) / RANKS, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass


def write_stopped(run_dir: Path, *, signum: int, step: int, checkpoint: Optional[Path], resume: str) -> dict[str, Any]:
    """Rank 0: what the launcher reports (launch/errors.py: RunStopped)."""
    record = {"signal": signal_name(signum), "step": step, "checkpoint": str(checkpoint) if checkpoint else None,
              "resume": resume}
    (Path(run_dir) / STOPPED).write_text(json.dumps(record) + "\n")
    return record
