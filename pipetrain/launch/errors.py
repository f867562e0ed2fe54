"""What a launch raises when a rank fails (torch-free: the CLI catches it without loading torch).

Its own module so the launchers that raise it (elastic.py) and the dispatcher that picks a
launcher (launcher.py) both depend on it, not on each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class RankFailedError(RuntimeError):
    """A rank raised (or died). The message is that rank's own one-line message; the full
    traceback, where the rank left one, is in `traceback_file` (run_dir/error_rank<r>.txt)."""

    def __init__(self, rank: int, message: str, traceback_file: Optional[Path] = None) -> None:
        where = f" (traceback: {traceback_file})" if traceback_file else ""
        super().__init__(f"rank {rank} failed: {message}{where}")
        self.rank, self.rank_message, self.traceback_file = rank, message, traceback_file


STOPPED = "stopped.json"  # rank 0 writes it when the run stops on a signal (train/stop.py)


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
