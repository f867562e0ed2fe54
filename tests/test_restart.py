"""launch.max_restarts: a rank SIGKILLed mid-run; torch elastic restarts the workers, which resume
from the newest verified checkpoint by themselves and end with the uninterrupted run's weights,
bitwise (fp32). The restart is one line on the console and an events.jsonl record."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from pipetrain.launch.local import worker_pids
from pipetrain.train.restart import failed_rank

STEPS, EVERY, KILL_AT = 20, 5, 7
ARGS = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.device=cpu", f"trainer.max_steps={STEPS}",
        f"trainer.ckpt_every={EVERY}", "logger=[console,jsonl]"]


def logged(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def final_tensors(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / f"step_{STEPS:06d}", tmp / f"{run.name}.pt")
    return torch.load(tmp / f"{run.name}.pt")


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkilled_rank_restarts_and_ends_bitwise_equal(tmp_path):
    run, ref = tmp_path / "run", tmp_path / "reference"
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *ARGS, "launch.max_restarts=2",
                            f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while logged(run) < KILL_AT and time.time() < deadline and job.poll() is None:
        time.sleep(0.02)
    ranks = worker_pids(job.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    found = re.search(r"restarted after rank ([01]) failed at step (\d+), resumed from step (\d+)", out)
    assert found, out[-3000:]
    assert KILL_AT <= int(found[2]) <= KILL_AT + 2 and found[3] == str(EVERY)
    event = json.loads((run / "events.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "restart" and event["resumed_step"] == EVERY and event["text"] == found[0]
    assert event["failed_rank"] == int(found[1]) and event["failed_step"] == int(found[2])
    # the steps redone after the restart have one row each: the redone one
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, STEPS + 1))

    res = run_cli([*ARGS, "logger=[jsonl]", f"hydra.run.dir={ref}"], cwd=tmp_path)  # never hurt
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = final_tensors(run, tmp_path), final_tensors(ref, tmp_path)
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise: weights, AdamW moments, RNG states


def _attempt(root: Path, n: int, errors: dict[int, int | None]) -> None:
    for rank, t in errors.items():
        d = root / f"attempt_{n}" / str(rank)
        d.mkdir(parents=True)
        if t is not None:
            (d / "error.json").write_text(json.dumps({"message": {"message": "x", "extraInfo": {"time_ns": str(t)}}}))


@pytest.mark.pure
def test_failed_rank_from_the_previous_attempts_error_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _attempt(tmp_path, 0, {0: 50, 1: None, 2: 40})  # rank 1 was killed: it left no error file
    _attempt(tmp_path, 1, {0: None, 1: None, 2: None})
    assert failed_rank(str(tmp_path / "attempt_1" / "0" / "error.json")) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    _attempt(tmp_path, 2, {0: None})
    for r, t in {0: 9, 1: 7, 2: 8}.items():  # every rank raised: the earliest is the cause
        (tmp_path / "attempt_1" / str(r) / "error.json").write_text(
            json.dumps({"message": {"message": "x", "extraInfo": {"time_ns": str(t)}}}))
    assert failed_rank(str(tmp_path / "attempt_2" / "0" / "error.json")) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert failed_rank(str(tmp_path / "attempt_0" / "0" / "error.json")) is None
