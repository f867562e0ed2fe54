"""`logger=[...,jsonl]`: metrics.jsonl (one JSON object per logged step) and summary.json.

metrics.jsonl is opened for appending, so a resumed run continues the same file. Each line
holds at least: step, loss, lr, grad_norm, tokens_per_s, step_time_s, bubble_fraction_mean,
bubble_fraction_per_rank, simulated_bubble_fraction, peak_memory_bytes_per_rank,
peak_activation_bytes_per_rank (train/monitor.py builds the record). summary.json is what
`pipetrain -m` sweeps read (sweep.py: tokens_per_s, bubble_fraction_mean,
peak_memory_bytes_per_rank, final_loss).
"""

from __future__ import annotations

import json
from typing import IO, Any, Optional

from pipetrain.loggers.base import Logger, RunInfo
from pipetrain.metrics.measure import StepMeasurement


class JsonlLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        self.file: Optional[IO[str]] = (info.run_dir / "metrics.jsonl").open("a")

    def log(self, step: int, record: dict[str, Any], measurement: Optional[StepMeasurement]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def finish(self, summary: dict[str, Any], last: Optional[StepMeasurement],
               chosen: Optional[StepMeasurement]) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        (self.info.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
