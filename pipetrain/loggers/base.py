"""The one small protocol every logger implements (loggers/factory.py builds them from `logger=[...]`).

Only rank 0 builds loggers (train/monitor.py gathers every rank's measurements to it first),
so a logger never thinks about ranks. Every hook has a no-op default, the way torchtitan's
loggers do: a logger overrides what it shows. A logger reads only the typed records the
trainer produces (metrics/step.py), never the trainer.

    start(info)                        once, before the first step
    progress(step)                     after every step (cheap: no metrics, no collective)
    log(record)                        at every logged step: its StepRecord (record.row() is
                                       what metrics.jsonl holds; record.measurement the
                                       measured step on every rank)
    note(text)                         a message for the user (checkpoints saved or resumed, ...)
    event(kind, text, fields)          something that happened to the run (kind "restart"): shown
                                       as `text`, recorded with its fields (default: as a note)
    finish(summary, last, chosen)      once, at the end: the RunSummary (already in
                                       summary.json), the last measured step's record and the
                                       one chosen by logging.trace_step
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.metrics.step import RunSummary, StepRecord


@dataclass(frozen=True)
class RunInfo:
    config: Config
    run_dir: Path
    max_steps: int
    start_step: int  # optimizer steps already done (a resumed run starts past 0)
    chosen_step: int  # the step the trace and the console timeline show (logging.trace_step)


class Logger:
    """No-op base: subclasses override the hooks they need."""

    def start(self, info: RunInfo) -> None:
        self.info = info

    def progress(self, step: int) -> None:
        pass

    def log(self, record: StepRecord) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def event(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        self.note(text)

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        pass


def human_bytes(n: Optional[float]) -> str:
    """1500 -> "1.5KB": decimal units, as the memory/*_gb metrics and plan.memory_gb count them
    (1 GB = 1e9 bytes), so the console and metrics.jsonl show the same number."""
    if n is None:
        return "-"
    if abs(n) < 1000:
        return f"{n:.0f}B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
    return f"{n / 1000:.1f}TB"
