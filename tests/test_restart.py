"""launch.max_restarts: a rank SIGKILLed mid-run; the launcher restarts every rank, which resume
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


@pytest.mark.pure
def test_failed_rank_is_the_one_that_ended_before_the_launcher_stopped_the_others(tmp_path, monkeypatch):
    """Rank 3 was killed; rank 1, busy, was stopped by the launcher before it wrote its error: both
    left none. The launcher wrote which had ended by themselves (launch/agent.py: ENDED)."""
    from pipetrain.launch.agent import ENDED_FIRST, root_cause
    from pipetrain.launch.errors import ENDED
    from pipetrain.parallel.layout import Layout

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _attempt(tmp_path, 0, {0: 50, 1: None, 2: 40, 3: None})
    _attempt(tmp_path, 1, {0: None})
    assert failed_rank(str(tmp_path / "attempt_1" / "0" / "error.json")) == 1  # without the record: the lowest
    (tmp_path / "attempt_0" / ENDED).write_text(json.dumps({"3": -9}))
    assert failed_rank(str(tmp_path / "attempt_1" / "0" / "error.json")) == 3
    lost = {"message": "RuntimeError: Connection closed by peer", "extraInfo": {"time_ns": "5"}}
    err = root_cause({0: lost, 2: lost}, layout=Layout(2, 2), exits={ENDED_FIRST: {3: -9}, 1: -9, 3: -9})
    assert str(err).startswith("rank 3 (pp 1, dp_replicate 1) failed: killed by SIGKILL; rank 0 (pp 0, "), err


def _rank_pid(run: Path, rank: int) -> int:
    try:
        return json.loads((run / f".lock.rank{rank}").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.e2e
@pytest.mark.slow
def test_restart_lines_under_data_parallel_name_the_global_rank_and_restarts_used_up(tmp_path):
    """pp=2 x dp_replicate=2: global rank 3 is pipeline rank 1 of the second pipeline. Killed once,
    the restart line names it with its coordinates; killed again with launch.max_restarts=1, the
    run ends in one line that says the restarts are used up."""
    run = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    args = [*ARGS, "data.batch_size=8", "parallel.dp_replicate=2", "trainer.max_steps=400", "trainer.ckpt_every=3",
            "launch.max_restarts=1", f"hydra.run.dir={run}"]
    job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *args], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while logged(run) < 4 and time.time() < deadline and job.poll() is None:
        time.sleep(0.02)
    first = _rank_pid(run, 3)
    assert first, "rank 3 did not record itself"
    rows = logged(run)
    os.kill(first, signal.SIGKILL)
    while (_rank_pid(run, 3) in (0, first) or logged(run) <= rows) and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)  # the restarted group's rank 3, once the group has said so and logged a step
    os.kill(_rank_pid(run, 3), signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode != 0
    assert re.search(r"restarted after rank 3 \(pp 1, dp_replicate 1\) failed at step \d+, resumed from step \d+",
                     out), out[-3000:]
    lines = err.strip().splitlines()  # the killed rank, not a peer that lost its connection to it
    assert len(lines) == 1 and lines[0].startswith(
        "pipetrain: error: launch.max_restarts=1 restarts used up: rank 3 (pp 1, dp_replicate 1) failed: "), err[-3000:]


@pytest.mark.pure
def test_root_cause_is_the_killed_rank_its_peers_lost_and_the_last_attempts(tmp_path):
    from pipetrain.launch.agent import error_records, root_cause
    from pipetrain.parallel.layout import Layout

    def record(t: int, message: str) -> dict:
        return {"message": message, "extraInfo": {"time_ns": str(t), "py_callstack": "trace"}}

    lost = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:9612"
    layout = Layout(2, 2)
    err = root_cause({0: record(5, lost), 1: record(6, lost), 2: record(7, lost)}, layout=layout, exits={1: 1})
    assert str(err).startswith("rank 3 (pp 1, dp_replicate 1) failed: ended without an error of its own"), err
    # the first error is a cause of its own: it stays the cause, whoever left no file
    err = root_cause({0: record(5, "ValueError: bad"), 1: record(6, lost)}, layout=layout, restarts=2,
                     exits={1: 1})
    assert str(err) == "launch.max_restarts=2 restarts used up: rank 0 (pp 0, dp_replicate 0) failed: ValueError: bad"
    for attempt, message in ((0, "attempt 0's"), (1, "attempt 1's")):  # restarts: the last attempt tells
        d = tmp_path / "run_x" / f"attempt_{attempt}" / "0"
        d.mkdir(parents=True)
        (d / "error.json").write_text(json.dumps({"message": record(1, message)}))
    assert error_records(tmp_path)[0]["message"] == "attempt 1's"


@pytest.mark.pure
def test_root_cause_of_a_timed_out_wait_is_the_rank_that_never_came():
    """A rank stuck (SIGSTOP, a hang) leaves no error: its peers time out, in a transfer (comm.py's
    P2PError) or a collective (gloo's words), and the launcher killed it. It is the one that failed."""
    from pipetrain.launch.agent import root_cause
    from pipetrain.parallel.layout import Layout

    def record(t: int, message: str) -> dict:
        return {"message": message, "extraInfo": {"time_ns": str(t), "py_callstack": "trace"}}

    layout = Layout(2, 2)
    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
            "waiting 20000ms for recv operation to complete")
    err = root_cause({0: record(5, gloo), 2: record(6, gloo), 3: record(7, gloo)}, layout=layout, exits={1: -9})
    assert str(err) == ("rank 1 (pp 0, dp_replicate 1) failed: stuck or dead (killed by SIGKILL): rank 0 (pp 0, "
                        "dp_replicate 0) timed out first: waited 20s in a collective (pipeline.p2p_timeout_s bounds "
                        "every wait after the first step)")
    p2p = "P2PError: rank 3: 1F0 on rank 3 waiting for ... from rank 1 timed out after 3s: rank 1 is stuck or dead"
    err = root_cause({3: record(5, p2p)}, layout=layout)  # exit codes unknown; ranks 0-2 wrote nothing
    assert str(err) == ("rank 0 (pp 0, dp_replicate 0) failed: stuck or dead (left no error of its own): "
                        f"rank 3 (pp 1, dp_replicate 1) timed out first: {p2p}")
    # every rank wrote one: the first timeout is the cause, as any first error
    err = root_cause({r: record(5 + r, p2p) for r in range(4)}, layout=layout)
    assert str(err) == f"rank 0 (pp 0, dp_replicate 0) failed: {p2p}"
