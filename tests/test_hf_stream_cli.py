"""A streamed mixture, run as a user runs it: resumed from the checkpoint of step 7 it repeats the
uninterrupted run's batches (its data/ tokens per source) and losses exactly, and at dp=2 it reads the
same batches (#46)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

datasets = pytest.importorskip("datasets")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def test_a_streamed_run_resumed_at_step_7_repeats_the_uninterrupted_run(tmp_path):
    docs = [f"document {i}: " + "some words of it. " * (1 + i % 7) for i in range(300)]
    datasets.Dataset.from_dict({"text": docs}).to_json(tmp_path / "web.jsonl")
    datasets.Dataset.from_dict({"text": [d.upper() for d in docs[:60]]}).to_json(tmp_path / "code.jsonl")
    common = ["data=datasets", "data.sources=[{path: web.jsonl, weight: 0.7}, {path: code.jsonl, weight: 0.3}]",
              "data.streaming=true", "data.batch_size=8", "data.seq_len=32", "pipeline.microbatches=4",
              "trainer.log_every=1", "trainer.eval_every=0", "optim.decay_steps=12", "model.n_layer=2"]
    env = {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    whole = tmp_path / "whole"
    res = run_cli([*common, "trainer.max_steps=12", "trainer.ckpt_every=7", f"hydra.run.dir={whole}"],
                  cwd=tmp_path, env_extra=env)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = whole / "checkpoints" / "step_000007"
    state = json.loads((saved / "meta.json").read_text())["data_state"]
    assert state["next_step"] == 7 and [s["name"] for s in state["sources"]] == ["web", "code"]
    want = rows(whole)
    for name, layout in (("resumed", []), ("resumed-dp2", ["pipeline.degree=1", "parallel.dp_replicate=2"])):
        run = tmp_path / name
        res = run_cli([*common, *layout, "trainer.max_steps=12", f"trainer.resume={saved}", f"hydra.run.dir={run}"],
                      cwd=tmp_path, env_extra=env)
        assert res.returncode == 0, res.stderr[-3000:]
        got = rows(run)
        assert sorted(got) == list(range(8, 13))
        for step, row in got.items():
            data = {k: v for k, v in row.items() if k.startswith("data/")}
            assert data == {k: v for k, v in want[step].items() if k.startswith("data/")}, (name, step)
            if not layout:  # the same layout: bitwise (== on floats)
                assert row["train/loss"] == want[step]["train/loss"], (step, row["train/loss"], want[step])
            else:  # another reduction order: the same batches, losses to float precision
                assert abs(row["train/loss"] - want[step]["train/loss"]) < 1e-4, (step, row, want[step])
