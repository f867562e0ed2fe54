"""SIGTERM to `pipetrain` (how SLURM preempts; the launcher passes it to every rank): the
ranks finish the step they are in, save it, and the command ends within 30 s with one line
saying where to resume; resuming repeats the uninterrupted run's losses bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 12
ARGS = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.device=cpu", f"trainer.max_steps={STEPS}",
        "logger=[console,jsonl]"]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows}


def logged_steps(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def start_until_step(args: list[str], run: Path, cwd: Path, steps: int) -> subprocess.Popen:
    """`pipetrain args hydra.run.dir=run` in a session of its own, returned once `steps` steps are logged."""
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *args, f"hydra.run.dir={run}"], cwd=cwd,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while logged_steps(run) < steps and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert job.poll() is None, job.communicate()[1][-3000:]
    return job


def test_sigterm_saves_the_step_and_resume_repeats_the_run(tmp_path):
    run = tmp_path / "run"
    job = start_until_step(ARGS, run, tmp_path, 5)
    job.send_signal(signal.SIGTERM)  # the launcher only, as SLURM's scancel / preemption does first
    sent = time.time()
    out, err = job.communicate(timeout=60)
    took = time.time() - sent
    assert took < 30, took
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    step = stopped["step"]
    assert 5 <= step < STEPS
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    assert lines[0] == (f"pipetrain: stopped by SIGTERM after step {step}: checkpoint {ckpt}; "
                        f"resume with trainer.resume={ckpt}")
    assert (ckpt / "meta.json").is_file()
    assert sorted(losses(run)) == list(range(1, step + 1))
    assert not list(run.glob("error_rank*")) and not (run / ".lock").exists()

    res = run_cli([*ARGS, "trainer.resume=auto", f"hydra.run.dir={run}"], cwd=tmp_path)  # the second leg
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {ckpt} at step {step}" in res.stdout
    assert not (run / "stopped.json").exists()

    ref = tmp_path / "reference"  # the uninterrupted run
    res = run_cli([*ARGS, "logger=[jsonl]", f"hydra.run.dir={ref}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == losses(ref)  # bitwise, every step
