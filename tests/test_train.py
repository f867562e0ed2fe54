"""Tier 3: training end to end through the `pipetrain` command (real processes, real files)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e


def test_quickstart_trains_with_a_falling_loss(tmp_path):
    """`pipetrain` with no arguments: GPT-2 tiny, built-in corpus, 2 ranks, 1F1B, CPU. .ci/run has just
    run exactly that, as the README says, and names its run dir and output: then this checks that run
    (the suite does not train the same 200 steps twice); anywhere else it runs it here."""
    ran, printed = os.environ.get("PIPETRAIN_QUICKSTART_RUN"), os.environ.get("PIPETRAIN_QUICKSTART_OUT")
    if ran and printed:
        run, stdout = Path(ran), Path(printed).read_text()
    else:
        res = run_cli([f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        run, stdout = tmp_path / "run", res.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 200
    assert summary["train/loss"] <= 0.8 * summary["train/first_loss"], summary
    assert summary["train/val_loss"] is not None and summary["train/val_loss"] < 0.8 * summary["train/first_loss"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[-1]["step"] == 200 and len(rows) >= 20
    assert "step 100/200" in stdout  # progress printed as it goes
    assert (run / "simulate.json").exists()  # simulated before it launched


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_llama_tiny_trains_with_a_falling_loss(tmp_path, schedule):
    """`pipetrain model=llama-tiny`: the Llama family (GQA, RoPE, SwiGLU, tied head across ranks),
    built on meta and materialized per rank, trains on the built-in corpus."""
    res = run_cli(["model=llama-tiny", f"schedule={schedule}", "trainer.max_steps=40", "trainer.eval_every=0",
                   "data.batch_size=8", "data.seq_len=32",
                   "trainer.ckpt_at_end=false", "sim.timeline=false", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["train/loss"] <= 0.6 * summary["train/first_loss"], summary


def test_training_sweep_ends_with_a_full_summary_table(tmp_path):
    """A 2 x 2 sweep ends with one table of every job. summary.json is the trainer's to write, so a
    sweep with the console logger only (no jsonl) still gets every column filled."""
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "schedule=1f1b,zbv", "pipeline.microbatches=8,16", "model=mlp", "sim.timeline=false",
                   "trainer.max_steps=2", "trainer.eval_every=0", "trainer.ckpt_at_end=false", "logger=[console]",
                   f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert {(r["schedule"], r["microbatches"]) for r in rows} == {(s, m) for s in ("1f1b", "zbv") for m in (8, 16)}
    for r in rows:  # the training table, every column filled
        assert {"perf/tokens_per_s", "pipeline/bubble_measured", "memory/peak_gb", "train/loss"} <= set(r), r
        assert all(v is not None for v in r.values()), r
        assert r["perf/tokens_per_s"] > 0 and r["train/loss"] > 0
    csv = (sweep / "sweep_summary.csv").read_text().splitlines()
    assert csv[0].startswith("job,schedule,degree,microbatches,perf/tokens_per_s") and len(csv) == 5
    assert not list(sweep.glob("*/metrics.jsonl"))  # no jsonl logger ran
    assert "sweep summary" in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["data.batch_size=6"], "data.batch_size=6"),  # does not split into 8 microbatches
        (["pipeline.degree=8", "schedule=interleaved_1f1b"], "pipeline.degree"),  # 16 stages, 10 layers
        (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path"),
    ],
)
def test_bad_input_fails_before_any_process_starts(tmp_path, args, needle):
    res = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr and needle in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3, res.stderr  # one clear message
    assert not list(tmp_path.glob("run/error_rank*"))  # nothing was spawned


BLOW_UP = ["optim.lr=1e9", "optim.min_lr=0", "optim.warmup_steps=0", "optim.grad_clip=0", "trainer.max_steps=4",
           "trainer.eval_every=0", "trainer.ckpt_at_end=false"]


def test_nonfinite_loss_stops_with_the_step(tmp_path):
    res = run_cli([*BLOW_UP, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
    assert res.returncode != 0
    assert "at step 2" in res.stderr and "trainer.on_nonfinite=skip" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_nonfinite_loss_skips_the_step_when_asked(tmp_path):
    res = run_cli([*BLOW_UP, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=4",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["train/skipped_steps"] == 3  # step 1 blew the weights up


def test_nonfinite_skips_stop_at_the_limit(tmp_path):
    """Every step after the first is non-finite: skipping stops at trainer.max_skipped_steps in a row."""
    res = run_cli([*BLOW_UP, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
    assert res.returncode != 0
    assert "2 non-finite steps in a row" in res.stderr and "at step 3" in res.stderr, res.stderr[-2000:]
    assert "trainer.max_skipped_steps" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_a_resume_with_more_steps_keeps_the_cosine_it_was_started_with(tmp_path):
    """4 steps, then the same run resumed to 8: the lr used to jump back up the re-stretched cosine.
    It now keeps the 4-step cosine (min_lr from step 5) and says so; optim.decay_steps stretches it.
    The done line's first loss was the resumed segment's: it is step 1's, from the checkpoint."""
    import json

    from conftest import run_cli

    base = ["model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=2",
            "logger=[console,jsonl]", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1",
            "trainer.eval_every=0", "trainer.log_every=1"]

    def lrs(run) -> dict[int, float]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}

    run, stretched = tmp_path / "run", tmp_path / "stretched"
    first = run_cli([*base, "trainer.max_steps=4", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(run, stretched)  # the same 4-step run, resumed below with optim.decay_steps=8
    more = run_cli([*base, "trainer.max_steps=8", "trainer.resume=auto", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert ("lr: the cosine keeps the length the run was started with, 4 steps (trainer.max_steps is now 8): "
            "set optim.decay_steps=8 to stretch it") in more.stdout, more.stdout[-3000:]
    assert all(lrs(run)[s] == pytest.approx(1e-4) for s in range(5, 9)), lrs(run)
    # the done line starts from the run's step 1, not the resumed segment's first step
    began = re.search(r"^done: 4 steps, loss (\d+\.\d+) -> ", first.stdout, re.M)
    again = re.search(r"^done: 8 steps \(resumed at step 4\), loss (\d+\.\d+) -> ", more.stdout, re.M)
    assert began and again and began.group(1) == again.group(1), (first.stdout[-500:], more.stdout[-500:])
    res = run_cli([*base, "trainer.max_steps=8", "optim.decay_steps=8", "trainer.resume=auto",
                   f"hydra.run.dir={stretched}"], cwd=tmp_path)
    assert res.returncode == 0 and "the cosine keeps" not in res.stdout, res.stderr[-3000:]
    from pipetrain.config.train import OptimConfig
    from pipetrain.train.optim import lr_at

    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1)  # step s trains with lr_at(s - 1)
    assert [lrs(stretched)[s] for s in range(5, 9)] == pytest.approx([lr_at(s - 1, cfg, 8) for s in range(5, 9)])
    assert lrs(stretched)[5] > 1.5e-4
