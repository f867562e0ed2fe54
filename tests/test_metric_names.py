"""Metric names in namespaces (train/, perf/, pipeline/, memory/; per rank `/rank<r>`, per stage
`pipeline/stage<s>/`), the same in metrics.jsonl, summary.json, wandb and TensorBoard, and the
wandb runs of a sweep grouped by the sweep. Real processes, wandb offline, real event files."""

from __future__ import annotations

import json
import re

import pytest

from _logs import tensorboard_scalars, wandb_records
from conftest import run_cli
from pipetrain.cli import sweep_group

pytestmark = pytest.mark.e2e

NAMESPACES = {"train", "perf", "pipeline", "memory"}


@pytest.mark.slow
def test_sweep_jobs_log_one_set_of_names_everywhere_and_group_in_wandb(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "schedule=1f1b,zbv", "model=mlp", "trainer.max_steps=2", "trainer.log_every=1",
                   "trainer.eval_every=0", "trainer.ckpt_at_end=false", "sim.timeline=false", "logging.timeline=false",
                   "logger=[console,jsonl,tensorboard,wandb]", f"hydra.sweep.dir={sweep}"],
                  cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # piped (no terminal): the sweep table and per-rank tables fold, never cut; memory in human
    # units; no per-job timeline before the table
    table = res.stdout[res.stdout.index("sweep summary"):]
    assert "…" not in res.stdout and "1f1b" in table and "zbv" in table
    assert re.search(r"\d\.\d(KB|MB)", table) and "measured timeline" not in res.stdout
    groups = set()
    for job in ("0", "1"):
        run_dir = sweep / job
        rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
        assert sorted(rows) == [1, 2]
        for row in rows.values():
            assert {k.split("/")[0] for k in row if k not in ("step", "time")} == NAMESPACES, sorted(row)
            for key in ("train/loss", "train/lr", "perf/tokens_per_s", "pipeline/bubble_measured",
                        "pipeline/bubble_simulated", "memory/peak_gb", "memory/peak_gb/rank1",
                        "pipeline/bubble_measured/rank0", "pipeline/stage0/f_ms"):
                assert key in row, key
        summary = json.loads((run_dir / "summary.json").read_text())
        assert {k.split("/")[0] for k in summary if k != "steps"} == NAMESPACES
        assert summary["train/loss"] == rows[2]["train/loss"] and summary["memory/peak_gb"] > 0
        # TensorBoard: every number of every row, under the same name
        board = tensorboard_scalars(run_dir / "tensorboard")
        for step, row in rows.items():
            want = {k: v for k, v in row.items()
                    if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
            assert set(board[step]) == set(want)
            assert all(board[step][k] == pytest.approx(v, rel=1e-6) for k, v in want.items())
        # wandb: the same names in its history, and the run in the sweep's group
        (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        history = {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                groups.add(record.run.run_group)
            elif kind == "history":
                items = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in record.history.item}
                history[items["_step"]] = items
        for step, row in rows.items():
            assert history[step]["train/loss"] == pytest.approx(row["train/loss"])
            assert history[step]["pipeline/stage1/b_ms"] == pytest.approx(row["pipeline/stage1/b_ms"])
    assert groups == {sweep_group(str(sweep))}
    assert "memory/peak_gb" in (sweep / "sweep_summary.json").read_text()
