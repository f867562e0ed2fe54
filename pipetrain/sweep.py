"""Hydra callback: after a multirun, one comparison table over every job's simulate.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console


def collect(sweep_dir: Path) -> list[dict]:
    """simulate.json of every job under a sweep directory, in job order."""
    def job_num(p: Path) -> tuple[int, str]:
        name = p.parent.name
        return (int(name.split("_")[0]) if name.split("_")[0].isdigit() else 1 << 30, name)

    return [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/simulate.json"), key=job_num)]


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from pipetrain.schedules.render import summary_table

        sweep_dir = Path(config.hydra.sweep.dir)
        records = collect(sweep_dir)
        if not records:
            return
        (sweep_dir / "summary.json").write_text(json.dumps(records, indent=2) + "\n")
        console = Console()
        console.print(summary_table(records))
        console.print(f"sweep of {len(records)} runs: {sweep_dir / 'summary.json'}")
