"""`logger=[...,jsonl]`: metrics.jsonl, one JSON object per logged step.

metrics.jsonl is opened for appending, so a resumed run continues the same file; the rows of the
steps it is about to redo (logged after the checkpoint it resumed from, before a crash, a kill or a
restart) are dropped first, so every step has one row, the one whose weights went on. Each line
is a StepRecord's row() (metrics/step.py): `step` and every metric under its public name
(metrics/names.py: train/loss, train/lr, perf/tokens_per_s, pipeline/bubble_measured,
memory/peak_gb/rank0, ...), the names wandb and TensorBoard get too, and `time`: when the row was
written (unix seconds), which wandb and TensorBoard stamp on their records themselves.
events.jsonl gets one line per event of the run (a restart: its text, failed_rank, failed_step,
resumed_step, attempt). summary.json, what `pipetrain -m` sweeps read, is the trainer's to write, whatever the loggers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from pipetrain.files import AppendFile, write_text_atomic
from pipetrain.loggers.base import Logger, RunInfo
from pipetrain.metrics.step import RunSummary, StepRecord


class JsonlLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        path = info.run_dir / "metrics.jsonl"
        if path.exists():
            keep_rows_up_to(path, info.start_step or None)  # a fresh start keeps every row
        self.file: Optional[AppendFile] = AppendFile(path)  # each row whole or not at all (a full disk: one line)

    def log(self, record: StepRecord) -> None:
        if self.file is not None:
            row = json.dumps({**record.row(), "time": round(time.time(), 3)}) + "\n"  # unix s, to the ms
            self.file.write(row, what=f"step {record.step}'s row")

    def event(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        """events.jsonl (metrics.jsonl stays one row per logged step): {"event", "text", ...fields}."""
        events = AppendFile(self.info.run_dir / "events.jsonl")
        try:
            events.write(json.dumps({"event": kind, "text": text, **fields}) + "\n", what=f"the {kind} event")
        finally:
            events.close()

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def keep_rows_up_to(path: Path, step: Optional[int]) -> None:
    """Rewrite metrics.jsonl without the rows past `step` (None: keep every step) and without a
    line torn by a kill mid-write, which the next row would otherwise continue; atomically, so a
    crash here leaves the old file whole. Untouched when there is nothing to drop."""
    text = path.read_text()
    lines = text.splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and (step is None or (isinstance(row.get("step"), int) and row["step"] <= step)):
            kept.append(line)
    if kept != lines or not text.endswith("\n"):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
