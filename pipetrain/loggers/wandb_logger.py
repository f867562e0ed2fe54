"""`logger=[...,wandb]`: Weights & Biases, imported only when asked for.

Logs the resolved config, every metric of every logged step under the names metrics.jsonl
has (metrics/names.py: `train/loss`, `pipeline/bubble_measured/rank1`, `memory/peak_gb`,
`pipeline/stage0/f_ms`, ...), the run's summary under the same names, and at the end two
tables: per rank (measured vs simulated bubble, memory, ms per op) and the measured timeline
of logging.trace_step. Project, entity, run name, group and tags come from logging.wandb_*;
the jobs of a `pipetrain -m` sweep share one group (its sweep directory) unless
logging.wandb_group says otherwise. Only rank 0 logs (it holds every rank's measurements).

With no credentials (WANDB_MODE unset, no WANDB_API_KEY, no `wandb login` entry in
~/.netrc) the run goes offline by itself and says how to sync it later, so a first run
never stops at a login prompt.

wandb itself prints nothing (`silent`: its ~30-line footer of history and summary no longer
fills the console, `console="off"`: it does not capture the console either); our one line says
where the run went: the offline folder and its sync command, or the online run's page.

The run id is kept in the run directory (`wandb_id.txt`): a run resumed from a checkpoint
(trainer.resume) continues that same wandb run, with `resume="allow"` (wandb marks it
resumed); a fresh start opens a new run and writes its id there.
"""

from __future__ import annotations

import dataclasses
import netrc
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from pipetrain.loggers.base import Logger, RunInfo
from pipetrain.metrics import names
from pipetrain.metrics.step import RunSummary, StepRecord

ID_FILE = "wandb_id.txt"  # in the run directory, next to checkpoints/
def has_credentials() -> bool:
    """An API key in the environment, an identity token file, or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        auth = netrc.netrc(path).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def run_identity(info: RunInfo) -> tuple[Optional[str], Optional[str]]:
    """(id, resume) for wandb.init: the id kept in the run directory when this run resumed from a
    checkpoint (start_step > 0), else (None, None): wandb picks a new id."""
    path = Path(info.run_dir) / ID_FILE
    kept = path.read_text().strip() if info.start_step > 0 and path.is_file() else ""
    return (kept, "allow") if kept else (None, None)


class WandbLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        import wandb  # lazily: only runs that ask for wandb pay for importing it

        self.wandb = wandb
        self.offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")
        if not os.environ.get("WANDB_MODE") and not has_credentials():
            os.environ["WANDB_MODE"] = "offline"
            self.offline = True
        cfg, log = info.config, info.config.logging
        name = log.wandb_name or f"{cfg.schedule.name}-p{cfg.pipeline.degree}-m{cfg.pipeline.microbatches}"
        run_id, resume = run_identity(info)
        self.run = wandb.init(
            project=log.wandb_project, entity=log.wandb_entity, name=name, tags=list(log.wandb_tags),
            group=log.wandb_group, job_type="train",
            config=dataclasses.asdict(cfg), dir=str(info.run_dir), settings=wandb.Settings(console="off", silent=True),
            id=run_id, resume=resume,
        )
        (Path(info.run_dir) / ID_FILE).write_text(self.run.id + "\n")
        if self.offline:
            print(f"wandb: no credentials (WANDB_API_KEY or `wandb login`), so this run is logged offline to "
                  f"{self.run_path()}; sync it later with: wandb sync {self.run_path()}", flush=True)
        elif self.run.url:
            print(f"wandb: {self.run.url}", flush=True)

    def run_path(self) -> str:
        return os.path.dirname(self.run.dir)  # .../wandb/offline-run-<time>-<id> (run.dir is its files/)

    def log(self, record: StepRecord) -> None:
        self.run.log(names.scalars(record.row()), step=record.step)

    def event(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        """In the run's summary (a log() without its step would move wandb's step counter): the
        latest event of each kind, its text and fields, and how many there were."""
        count = int(self.run.summary.get(f"{kind}/count", 0) or 0) + 1
        self.run.summary.update({f"{kind}/count": count, f"{kind}/text": text,
                                 **{f"{kind}/{k}": v for k, v in fields.items() if v is not None}})

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        tables: dict[str, Any] = {}
        if last is not None and last.measurement is not None:
            tables["per_rank"] = self._table(last.rank_rows())
        if chosen is not None and chosen.measurement is not None:
            tables["timeline"] = self._table(chosen.measurement.timeline_rows())
        if tables:
            self.run.log(tables, step=summary.steps, commit=True)  # before the summary, which must win
        self.run.summary.update({k: v for k, v in summary.to_json().items() if v is not None})
        self.run.finish()

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        columns = list(rows[0]) if rows else []
        data = [[str(v) if isinstance(v, list) else v for v in row.values()] for row in rows]
        return self.wandb.Table(columns=columns, data=data)
