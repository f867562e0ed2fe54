"""Schemas of the run's identity (`run.*`), its checkpoints (`checkpoint.*`) and restarts
(`launch.*`). Pure: no torch.

    pipetrain run.name=gpt2-long trainer.resume=auto checkpoint.keep_last=3 launch.max_restarts=2
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# A run name is one directory name: letters, digits and . _ - (no slash, not . or ..)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class RunConfig:
    # outputs/NAME instead of outputs/DATE/TIME: the same command finds the same directory again
    # (with trainer.resume=auto, its newest good checkpoint) after a restart or a SLURM requeue
    name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.name is not None and not _NAME.match(str(self.name)):
            raise ValueError(f"run.name={self.name!r} must be one directory name (letters, digits, '.', '_', '-', "
                             f"starting with a letter or digit): e.g. run.name=gpt2-long")


@dataclass
class CheckpointConfig:
    keep_last: int = 0  # keep the newest N good checkpoints, delete older ones (0: keep all)
    # write with DCP's async_save: training goes on while a background thread writes the files
    # (the copy to host memory still blocks; the time a save blocks training is reported)
    async_save: bool = False
    # timeout of the checkpoint phase's collectives (a gloo group of their own, not NCCL's 300 s
    # watchdog): ranks wait there while others write, hash before a resume, or delete old ones
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last must be >= 0 (got {self.keep_last}; 0 keeps every checkpoint)")
        if not self.timeout_s > 0:
            raise ValueError(f"checkpoint.timeout_s must be > 0 seconds (got {self.timeout_s}): e.g. "
                             f"checkpoint.timeout_s=3600 for a checkpoint of hundreds of GB")


@dataclass
class LaunchConfig:
    # cluster=local: the launcher restarts every rank up to N times after a rank fails; they
    # resume from the newest verified checkpoint of the run directory by themselves
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"launch.max_restarts must be >= 0 (got {self.max_restarts})")
