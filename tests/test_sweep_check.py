"""Multirun sweeps check every job's config (and schedule) before any job is launched or submitted."""

import pytest

from conftest import run_cli
from pipetrain.sweep import check_sweep, sweep_jobs, sweep_overrides


@pytest.mark.pure
def test_jobs_expand_in_hydras_order_and_the_first_bad_one_is_named():
    argv = ["-m", "--config-dir", "/x", "mode=simulate", "model=sleep", "schedule=1f1b,dualpipe", "pipeline.degree=2,3"]
    assert sweep_overrides(argv) == ["mode=simulate", "model=sleep", "schedule=1f1b,dualpipe", "pipeline.degree=2,3"]
    jobs = sweep_jobs(sweep_overrides(argv))
    assert [j[2:] for j in jobs] == [["schedule=1f1b", "pipeline.degree=2"],
                                     ["schedule=1f1b", "pipeline.degree=3"],
                                     ["schedule=dualpipe", "pipeline.degree=2"],
                                     ["schedule=dualpipe", "pipeline.degree=3"]]
    with pytest.raises(ValueError, match=r"^sweep job #3 \(.*schedule=dualpipe pipeline.degree=3\): dualpipe needs an "
                                         r"even pipeline.degree \(got 3\).*no job of the 4 was started"):
        check_sweep(argv)
    assert check_sweep(["-m", "mode=simulate", "model=sleep", "schedule=1f1b,zbv"]) == 2


@pytest.mark.e2e
def test_a_bad_submitit_sweep_fails_in_one_line_before_submitting(tmp_path):
    res = run_cli(["-m", "cluster=submitit_local", "schedule=dualpipe", "pipeline.degree=3"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipetrain: error: sweep job #0 (cluster=submitit_local"), res.stderr
    assert "even pipeline.degree" in lines[0]
    assert not (tmp_path / "multirun").exists()  # nothing launched, nothing submitted


@pytest.mark.pure
def test_the_sweep_table_prints_bubbles_in_percent():
    """Like the console and the simulate tables: 23.4%, not 0.2340 (the JSON keeps fractions)."""
    from rich.console import Console

    from pipetrain.metrics import names
    from pipetrain.sweep import train_table

    row = {"schedule": "zbv", "degree": 2, "microbatches": 8, names.TOKENS_PER_S: 1234.5, names.BUBBLE_SIM: 0.2341,
           names.BUBBLE: 0.25, names.PEAK_GB: 0.02, names.LOSS: 5.4321}
    console = Console(width=200, record=True)
    console.print(train_table([row]))
    text = console.export_text()
    assert "23.4%" in text and "25.0%" in text and "0.2341" not in text, text
