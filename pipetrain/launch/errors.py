"""What a launch raises when a rank fails (torch-free: the CLI catches it without loading torch).

Its own module so the launchers that raise it (agent.py) and the dispatcher that picks a
launcher (launcher.py) both depend on it, not on each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import traceback
from pathlib import Path
from typing import Optional

from pipetrain.launch.host_memory import oom_hint
from pipetrain.parallel.layout import Layout


def rank_text(rank: int, layout: Optional[Layout] = None) -> str:
    """A global rank named as its layout names it (Layout.rank_name: 'rank 3 (pp 1, dp_replicate 1)'),
    or a bare 'rank 3' where the layout is not known."""
    return f"rank {rank}" if layout is None else layout.rank_name(rank)


class RankFailedError(RuntimeError):
    """A rank raised (or died). The message is that rank's own one-line message; the full
    traceback, where the rank left one, is in `traceback_file` (run_dir/error_rank<r>.txt).
    `restarts`: launch.max_restarts, when the failure came after every restart was used."""

    def __init__(self, rank: int, message: str, traceback_file: Optional[Path] = None, *,
                 layout: Optional[Layout] = None, restarts: int = 0) -> None:
        where = f" (traceback: {traceback_file})" if traceback_file else ""
        spent = f"launch.max_restarts={restarts} restarts used up: " if restarts else ""
        super().__init__(f"{spent}{rank_text(rank, layout)} failed: {message}{where}")
        self.rank, self.rank_message, self.traceback_file = rank, message, traceback_file


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    hint = oom_hint(text)  # torch's host out-of-memory error says nothing of what to change
    if hint is not None:
        return hint
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def record_error(err: BaseException, path: str | None = None) -> None:
    """Write torchelastic's error file (the format of its ErrorHandler.record_exception), adding
    the time in ns: its own timestamp has whole seconds, too coarse to tell which rank failed
    first when a dying rank drags its peers down within the same second. Written whole or not at
    all (a rename): a rank killed mid-write must not leave a file that reads as no error."""
    path = path or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time_ns()
    data = {"message": {"message": one_line(err), "extraInfo": {
        "py_callstack": traceback.format_exc(), "timestamp": str(now // 10**9), "time_ns": str(now)}}}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(json.dumps(data))
    os.replace(partial, target)


# What a rank says when it leaves because the step in flight could not end after a signal (the
# launcher stops the survivors when a peer died): like a lost connection, never a cause.
UNFINISHED = "the step in flight did not finish in time"

# In an attempt's log folder (<logs>/attempt_<n>/), written by the launcher of cluster=local: {rank:
# exit code} of the ranks that had ended when it saw the attempt fail, before it stopped the others
# (launch/agent.py).
ENDED = "ended.json"

STOPPED = "stopped.json"  # rank 0 writes it when the run stops on a signal (train/stop.py)
STOPPED_EXIT = 143  # a rank's exit code after a stop on a signal: 128 + SIGTERM, as a shell reports it

# Every live rank holds a shared flock on <run_dir>/.ranks (the kernel drops it when the process
# ends, even on SIGKILL). A SIGTERM sent to the launcher's whole process group (scancel, `kill --
# -PGID`) also kills the multiprocessing fork server the CPU ranks were forked from; the launcher
# then sees its ranks as gone and stops waiting, while they still finish the step and save it.
# The launcher waits on this lock instead, so its one line reports the step they saved.
RANKS = ".ranks"


class RunStopped(RuntimeError):
    """The run stopped on a signal (SIGTERM, SIGINT) after saving its step. The message is the one
    line the user sees: which signal, after which step, and where to resume."""

    def __init__(self, record: dict) -> None:
        self.record = record
        ckpt, hint = record.get("checkpoint"), record.get("resume")
        where = f"checkpoint {ckpt}; {hint}" if ckpt else "no checkpoint (checkpoints are off)"
        super().__init__(f"stopped by {record.get('signal')} after step {record.get('step')}: {where}")

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process a signal ended (143: SIGTERM)."""
        return 128 + {"SIGINT": 2, "SIGTERM": 15, "SIGUSR2": 12}.get(str(self.record.get("signal")), 15)


def read_stopped(run_dir: Path) -> Optional[dict]:
    """What train/stop.py recorded when the ranks stopped on a signal, or None."""
    import json

    try:
        return json.loads((Path(run_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return None


def wait_for_stop(run_dir: Path, timeout_s: float = 120.0) -> None:
    """In the launcher, after a signal: return once no rank holds <run_dir>/.ranks (rank 0 wrote
    stopped.json before it ended), or after `timeout_s` (a stop is bounded by the step's grace time
    plus one checkpoint)."""
    path, deadline = Path(run_dir) / RANKS, time.monotonic() + timeout_s
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # no rank got as far as building its trainer
        return
    try:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # every rank has ended
            except BlockingIOError:
                time.sleep(0.05)
    finally:
        os.close(fd)
