"""`logger=[...,tensorboard]`: TensorBoard event files in `<run dir>/tensorboard/`.

Every metric of every logged step under the names metrics.jsonl and wandb have
(metrics/names.py: `train/loss`, `perf/tokens_per_s`, `pipeline/bubble_measured/rank0`,
`memory/peak_gb`, `pipeline/stage0/f_ms`, ...; TensorBoard groups charts by the part before the
first `/`), the resolved config as text, and the run's summary at its last step. Written with
tensorboardX (pure Python, its protobuf comes with wandb), so TensorBoard itself is only needed
to look: `tensorboard --logdir outputs/`. A resumed run appends to the same directory, and
marks the steps it redoes (logged after the checkpoint it resumed from) as purged, so TensorBoard
shows one point per step, the redone one (SummaryWriter's purge_step, as metrics.jsonl drops those rows).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from pipetrain.loggers.base import Logger, RunInfo
from pipetrain.metrics import names
from pipetrain.metrics.step import RunSummary, StepRecord

TB_DIR = "tensorboard"


class TensorBoardLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        from tensorboardX import SummaryWriter  # lazily: only runs that ask for it import it

        purge = info.start_step + 1 if info.start_step > 0 else None  # the first step this run redoes
        # The event file is named by the second it was opened and the host: a run resumed within the
        # same second would truncate the earlier file; the pid keeps the two apart.
        self.writer: Optional[SummaryWriter] = SummaryWriter(logdir=str(info.run_dir / TB_DIR), purge_step=purge,
                                                             filename_suffix=f".{os.getpid()}")
        config = json.dumps(dataclasses.asdict(info.config), indent=2, default=str)
        self.writer.add_text("config", f"```\n{config}\n```", global_step=info.start_step)

    def log(self, record: StepRecord) -> None:
        if self.writer is not None:
            for key, value in names.scalars(record.row()).items():
                self.writer.add_scalar(key, value, global_step=record.step)

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        if self.writer is None:
            return
        done = {k: v for k, v in names.scalars(summary.to_json()).items() if k != "steps"}
        self.writer.add_text("summary", "\n".join(f"    {k}: {v:.6g}" for k, v in done.items()),
                             global_step=summary.steps)
        self.writer.close()
        self.writer = None
