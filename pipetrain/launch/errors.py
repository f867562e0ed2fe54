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
