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
