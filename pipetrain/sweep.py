"""Sweeps (`pipetrain -m`): every job checked before any starts, and one comparison table after.

`check_sweep` expands the command line's sweep as Hydra's basic sweeper will (the same job
order and numbers), composes and checks each job's config and schedule, and stops at the first
bad job with one line naming it, before any job is launched or submitted (a SLURM job no longer
fails minutes later in its own log).

The Hydra callback: after a multirun, one comparison table over every job.

Simulate sweeps compare each job's simulate.json; training sweeps add the trained
results from each job's summary.json (tokens/s, final loss, measured bubble and peak
memory where the run reported them). Written to sweep_summary.json and .csv in the
sweep directory and printed as a rich table.
"""

from __future__ import annotations

import csv
import shutil
import json
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from pipetrain.loggers.base import human_bytes
from pipetrain.loggers.tables import print_table
from pipetrain.metrics import names

# the run's metrics under their public names (metrics/names.py), beside what the job was
TRAIN_COLUMNS = ("schedule", "degree", "microbatches", names.TOKENS_PER_S, names.BUBBLE_SIM, names.BUBBLE,
                 names.PEAK_GB, names.LOSS)
# overrides both tables show in a column of their own; any other key the sweep varies gets one too,
# as a row field "swept:KEY" (simulate.json has fields named like some knobs: partition)
SHOWN = ("schedule", "pipeline.degree", "pipeline.microbatches", "schedule.virtual_stages")
SWEPT = "swept:"


def _job_dirs(sweep_dir: Path) -> list[Path]:
    def key(p: Path) -> tuple[int, str]:
        head = p.name.split("_")[0]
        return (int(head) if head.isdigit() else 1 << 30, p.name)

    return sorted((p.parent for p in sweep_dir.glob("*/simulate.json")), key=key)


def collect(sweep_dir: Path) -> list[dict]:
    """simulate.json of every job under a sweep directory, in job order."""
    return [json.loads((d / "simulate.json").read_text()) for d in _job_dirs(sweep_dir)]


def swept(sweep_dir: Path) -> tuple[list[tuple[str, str]], dict[str, dict[str, str]]]:
    """The overrides whose values differ between the jobs (`partition=uniform,balanced`), other than
    those the tables show anyway (SHOWN), in command-line order, as (row field "swept:partition",
    header "partition") pairs; and job directory -> its values of them (Hydra's
    `.hydra/overrides.yaml` of each job)."""
    from omegaconf import OmegaConf

    jobs: dict[str, dict[str, str]] = {}
    for d in _job_dirs(sweep_dir):
        path = d / ".hydra" / "overrides.yaml"
        items = OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else []
        jobs[d.name] = dict(str(o).lstrip("+~").split("=", 1) for o in items or [] if "=" in str(o))
    keys = list(dict.fromkeys(k for values in jobs.values() for k in values))
    varied = [k for k in keys if k not in SHOWN and not k.startswith("hydra.")
              and len({values.get(k) for values in jobs.values()}) > 1]
    return [(SWEPT + k, k) for k in varied], {job: {SWEPT + k: values.get(k, "-") for k in varied}
                                              for job, values in jobs.items()}


def train_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for d in _job_dirs(sweep_dir):
        if not (d / "summary.json").exists():
            continue
        sim = json.loads((d / "simulate.json").read_text())
        summ = json.loads((d / "summary.json").read_text())
        rows.append({
            "job": d.name, "schedule": sim["schedule"], "degree": sim["degree"], "microbatches": sim["microbatches"],
            names.TOKENS_PER_S: summ.get(names.TOKENS_PER_S),
            # simulated with the run's measured costs where it measured a step, else simulate.json's
            names.BUBBLE_SIM: summ.get(names.BUBBLE_SIM, sim["bubble_fraction_mean"]),
            names.BUBBLE: summ.get(names.BUBBLE), names.PEAK_GB: summ.get(names.PEAK_GB),
            names.LOSS: summ.get(names.LOSS),
        })
    return rows


def train_table(rows: list[dict[str, Any]], extra: Sequence[tuple[str, str]] = ()) -> Table:
    """One row per trained job; `extra`: (row field, header) of the swept keys the fixed columns do not
    show, after the schedule."""
    fields = [field for field, _ in extra]
    columns = (TRAIN_COLUMNS[0], *fields, *TRAIN_COLUMNS[1:])
    table = Table(title="sweep summary", pad_edge=False)
    table.add_column(TRAIN_COLUMNS[0], justify="left")
    for _, header in extra:
        table.add_column(header, justify="left")
    for c in TRAIN_COLUMNS[1:]:
        table.add_column(c.replace("_", " ").replace("/", "\n", 1), justify="right")

    def fmt(c: str, v: Any) -> str:
        if v is None:
            return "-"
        if c == names.PEAK_GB:
            return human_bytes(v * 1e9)
        if c in (names.BUBBLE, names.BUBBLE_SIM):  # fractions in the JSON, percent on screen as everywhere
            return f"{100 * v:.1f}%"
        return f"{v:,.0f}" if isinstance(v, float) and v > 100 else (f"{v:.4f}" if isinstance(v, float) else str(v))

    for r in rows:
        table.add_row(*(str(r[c]) if c in fields else fmt(c, r[c]) for c in columns))
    return table


# Hydra's flags that take a value (the next argument); everything else with "=" is an override.
VALUE_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun")


def sweep_overrides(argv: Sequence[str]) -> list[str]:
    """The config overrides of a command line (Hydra's own flags and their values left out)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in VALUE_FLAGS:
            skip = True
        elif "=" in arg and not arg.startswith("-"):
            out.append(arg)
    return out


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    """Each job's overrides, in Hydra's basic sweeper's order (job #0 first)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pipetrain.compat_hydra import sweep_batches

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in sweep_batches(parsed) for job in batch]


def check_sweep(argv: Sequence[str], config_dirs: Sequence[str] = ()) -> int:
    """Compose and check every job of the sweep on this command line; raise ValueError naming
    the first bad one. Returns the number of jobs."""
    from pipetrain.compose import compose_config, search_path
    from pipetrain.plan import build_schedule  # pure: schedules only, no torch

    search = search_path(config_dirs)
    jobs = sweep_jobs(sweep_overrides(argv))
    for num, job in enumerate(jobs):
        try:
            config = compose_config([*job, *search])
            build_schedule(config)
            if config.cluster.name == "slurm" and shutil.which("sbatch") is None:
                raise ValueError("cluster=slurm submits with sbatch, which is not on this machine's PATH: run it on "
                                 "a SLURM login node; `python -m pipetrain.launch.sbatch cluster=slurm ...` writes "
                                 "the script to submit by hand")
        except (ValueError, TypeError, FileNotFoundError) as e:
            mine = " ".join(o for o in job if not o.startswith("hydra."))
            raise ValueError(f"sweep job #{num} ({mine}): {e} (no job of the {len(jobs)} was started)") from None
    return len(jobs)


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from pipetrain.schedules.render import summary_table

        sweep_dir = Path(config.hydra.sweep.dir)
        console = Console()
        extra, values = swept(sweep_dir)
        trained = train_rows(sweep_dir)
        if trained:
            rows: list[dict[str, Any]] = [{**r, **values.get(r["job"], {})} for r in trained]
            print_table(console, train_table(rows, extra))
        else:
            # the swept values first in each row (and in the .csv's columns)
            rows = [{**values.get(d.name, {}), **r} for d, r in zip(_job_dirs(sweep_dir), collect(sweep_dir))]
            if not rows:
                return
            print_table(console, summary_table(rows, extra=extra))
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()} for r in rows]
        with (sweep_dir / "sweep_summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)
        console.print(f"sweep of {len(rows)} runs: {sweep_dir / 'sweep_summary.json'} (and .csv)")
