"""`logger=[...,jsonl]`: metrics.jsonl, one JSON object per logged step.

metrics.jsonl is opened for appending, so a resumed run continues the same file. Each line
is a StepRecord's row() (metrics/step.py): `step` and every metric under its public name
(metrics/names.py: train/loss, train/lr, perf/tokens_per_s, pipeline/bubble_measured,
memory/peak_gb/rank0, ...), the names wandb and TensorBoard get too.
events.jsonl gets one line per event of the run (a restart: its text, failed_rank, failed_step,
resumed_step, attempt). summary.json, what `pipetrain -m` sweeps read, is the trainer's to write, whatever the loggers.
"""

from __future__ import annotations

import json
from typing import IO, Any, Optional

from pipetrain.loggers.base import Logger, RunInfo
from pipetrain.metrics.step import RunSummary, StepRecord


class JsonlLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        self.file: Optional[IO[str]] = (info.run_dir / "metrics.jsonl").open("a")

    def log(self, record: StepRecord) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record.row()) + "\n")
            self.file.flush()

    def event(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        """events.jsonl (metrics.jsonl stays one row per logged step): {"event", "text", ...fields}."""
        with (self.info.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"event": kind, "text": text, **fields}) + "\n")

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
