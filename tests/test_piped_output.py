"""Off a terminal (SLURM logs, `| tee`, `| cat`: here a pipe) tables fold instead of cutting values
with `…`, and a sweep's jobs leave their timelines out (the comparison table has a row per job)."""

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e


def test_piped_sweep_tables_are_whole_and_timelines_summarized(tmp_path):
    res = run_cli(["-m", "mode=simulate", "model=gpt2", "partition=balanced", "schedule=interleaved_1f1b,dualpipev",
                   "pipeline.degree=4", "pipeline.microbatches=16", "data.batch_size=32", "parallel.dp_replicate=2",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "…" not in out
    assert "interleaved_1f1b" in out and "dualpipev" in out  # whole names in the tables
    assert " rank 0 │" not in out  # no per-job timeline: 2 jobs, one comparison table
    assert out.count("model=gpt2 partition=balanced: ") == 2  # each job's partition table
    assert "sweep of 2 runs" in out
    one = run_cli(["mode=simulate", "model=sleep", "schedule=zbv", "sim.timeline_width=60",
                   f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path)  # a single run still draws it
    assert one.returncode == 0 and " rank 0 │" in one.stdout and "…" not in one.stdout


def test_a_sweep_table_shows_every_swept_key(tmp_path):
    """`partition=uniform,balanced` was swept but had no column: the two rows looked alike (issue #44).
    Every key the sweep varies has a column (and a field in sweep_summary.json / .csv)."""
    import json

    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "mode=simulate", "model=gpt2-tiny", "partition=uniform,balanced", "pipeline.degree=4",
                   "sim.timeline=false", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [r["swept:partition"] for r in rows] == ["uniform", "balanced"], rows
    table = res.stdout[res.stdout.rindex("schedule"):]
    assert "partition" in table.splitlines()[0] and "uniform" in table and "balanced" in table, table
    assert (sweep / "sweep_summary.csv").read_text().splitlines()[0].startswith("swept:partition,"), "csv header"
