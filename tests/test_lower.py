"""trainer.compile keeps a schedule's B and W: a compiled stage's matrix-weight modules run eager between
its compiled graphs (parallel/parallelize.py apply_compile), so W holds their weight-gradient GEMMs and
the plan's schedule, costs and simulation are the eager run's (ZB-V, ZB-H1/H2, DualPipe's F&B pairs);
`schedules/lower.py split_on` says which compiled stages run B and W apart."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import run_cli
from pipetrain.plan import build_schedule, make_plan
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Op
from pipetrain.schedules.lower import split_on


@pytest.mark.pure
@pytest.mark.parametrize("name, ranks", [("zbv", 2), ("zbv", 4), ("zbh1", 4), ("zbh2", 2), ("dualpipev", 2),
                                         ("dualpipe", 4)])
def test_compiled_stages_keep_their_b_and_w_in_the_plan(compose, name, ranks):
    base = ["mode=simulate", "model=sleep", f"schedule={name}", f"pipeline.degree={ranks}",
            f"pipeline.microbatches={2 * ranks}", "parallel.dp_replicate=2", f"model.layers={4 * ranks}"]
    eager, compiled = (make_plan(compose([*base, f"trainer.compile={c}"])) for c in ("false", "true"))
    stages = compiled.schedule.placement.num_stages
    assert eager.compiled_stages == frozenset() and compiled.compiled_stages == frozenset(range(stages))
    assert compiled.schedule == eager.schedule and compiled.stage_costs == eager.stage_costs
    assert compiled.simulated.result.makespan == eager.simulated.result.makespan
    assert build_schedule(compose([*base, "trainer.compile=true"])) == compiled.schedule
    ops = {a.op for r in range(ranks) for a in compiled.schedule.actions(r)}
    assert {Op.B, Op.W} <= ops and split_on(compiled.schedule, range(stages))


@pytest.mark.pure
def test_split_on_names_the_stages_that_run_b_and_w_apart():
    assert split_on(registry.build("1f1b", 2, 4, 1), {0, 1}) == []
    assert split_on(registry.build("zbv", 2, 4, 2), {3})[:2] == ["3B0", "3W0"]


@pytest.mark.e2e
def test_simulate_writes_and_prints_b_and_w_for_compiled_stages(tmp_path: Path):
    """The issue's command: schedule.csv (torch's names: I the input gradient, W the weight gradient)
    keeps I and W under trainer.compile, and the timeline prints B and W."""
    res = run_cli(["mode=simulate", "trainer.compile=true", "schedule=zbv", f"hydra.run.dir={tmp_path / 'r'}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = list(csv.reader((tmp_path / "r" / "schedule.csv").read_text().splitlines()))
    ops = {cell.strip("0123456789") for row in rows for cell in row}
    assert ops == {"F", "I", "W"}, ops
    assert "trainer.compile: every stage keeps B and W apart" in res.stdout, res.stdout
