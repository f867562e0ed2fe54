"""Every message tells the truth in one line (issue #25): what a stop saved, which global rank
failed, that the disk is full, that a step was skipped. Real runs, real signals, real files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

def log_tail(run) -> str:
    """The end of the run's pipetrain.log: what the launcher printed, for a failure's message (a
    full-suite run once saw this test's launcher exit 143 with nothing on stderr)."""
    log = run / "pipetrain.log"
    return log.read_text()[-2000:] if log.exists() else "(no pipetrain.log)"


ARGS = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.device=cpu", "trainer.max_steps=200",
        "logger=[console,jsonl]"]


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_to_the_process_group_names_the_step_and_checkpoint_saved(tmp_path):
    """scancel / `kill -- -PGID` signal the launcher, its fork server and the ranks at once. The
    fork server used to die of it, so torch's agent stopped waiting for the ranks and the launcher
    said 'after step ?: no checkpoint (checkpoints are off)' while they went on to save the step."""
    from test_preempt import start_until_step

    run = tmp_path / "run"
    job = start_until_step(ARGS, run, tmp_path, 3)
    os.killpg(job.pid, signal.SIGTERM)  # the whole group, as SLURM's scancel does
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    step = stopped["step"]
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    assert (ckpt / "meta.json").is_file()
    assert err.strip().splitlines() == [f"pipetrain: stopped by SIGTERM after step {step}: checkpoint {ckpt}; "
                                        f"resume with trainer.resume={ckpt}"], (err[-3000:], log_tail(run))
    assert not (run / ".ranks").exists()  # rank 0 removes its stop-wait file


@pytest.mark.e2e
@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_says_so_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    """checkpoints/ on a 30 MB tmpfs: step 2's checkpoint (~21 MB) fits, step 4's does not. It used
    to end in ~200 lines of DCP tracebacks ('unexpected pos 704 vs 598') without the words. The
    background write (checkpoint.async_save=true) fails at its commit: the same line."""
    from conftest import run_cli

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(ckpts)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        res = run_cli([*ARGS, "trainer.max_steps=4", "trainer.ckpt_every=2", "logger=[jsonl]",
                       f"checkpoint.async_save={str(async_save).lower()}", f"hydra.run.dir={tmp_path / 'run'}"],
                      cwd=tmp_path)
        names = sorted(p.name for p in ckpts.iterdir())
        intact = (ckpts / "step_000002" / "meta.json").is_file()
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert re.fullmatch(
        rf"pipetrain: error: rank \d failed: DiskFull: checkpoint of step 4: no space left on device in "
        rf"{re.escape(str(ckpts))}; its partial files were removed and the previous checkpoint "
        rf"{re.escape(str(ckpts / 'step_000002'))} is intact: free space "
        rf"there, or lower checkpoint.keep_last \(traceback: .*\)", lines[0]), lines[0]
    assert names == ["step_000002"] and intact  # the staging directory .step_000004.tmp is gone


@pytest.mark.e2e
def test_each_skipped_step_has_a_console_line(tmp_path):
    """optim.lr=1e9: step 1's update leaves the weights non-finite, so every later step is skipped
    (trainer.on_nonfinite=skip). Only logged steps (here the first and last) used to show anything,
    and they showed a metrics line as if the step had trained."""
    from conftest import run_cli

    res = run_cli([*ARGS, "trainer.max_steps=4", "trainer.log_every=100", "trainer.ckpt_every=0",
                   "trainer.ckpt_at_end=false", "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=10",
                   "optim.lr=1e9", "optim.warmup_steps=0", "logger=[console]", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    skipped = [line for line in res.stdout.splitlines() if line.startswith("step ") and ": skipped" in line]
    assert skipped == [f"step {s}: skipped, loss nan / grad norm nan not finite (trainer.on_nonfinite=skip): weights "
                       f"not updated, {s - 1} in a row of trainer.max_skipped_steps=10" for s in (2, 3, 4)], res.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_a_stopped_rank_is_reported_within_the_p2p_timeout_and_named(tmp_path):
    """pp=2 x dp_replicate=2, global rank 1 SIGSTOPped: its pipeline peer (global rank 3) times out
    after pipeline.p2p_timeout_s and names it with its coordinates. The report took 30 s more (torch
    waited 30 s for the stopped rank to act on SIGTERM) and named pipeline indices ('rank 0')."""
    from test_preempt import logged_steps

    from pipetrain.launch.local import worker_pids

    run, timeout_s = tmp_path / "run", 3
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    args = [*ARGS, "data.batch_size=8", "logger=[jsonl]", "trainer.ckpt_every=0", "trainer.ckpt_at_end=false",
            "pipeline.degree=2", "parallel.dp_replicate=2", f"pipeline.p2p_timeout_s={timeout_s}",
            f"hydra.run.dir={run}"]
    with (tmp_path / "err.txt").open("w") as err:  # a file: the stopped rank holds the launcher's stderr open
        job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *args], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.time() + 300
        while logged_steps(run) < 3 and time.time() < deadline and job.poll() is None:
            time.sleep(0.05)
        ranks = worker_pids(job.pid)  # started in rank order
        assert job.poll() is None and len(ranks) == 4, (tmp_path / "err.txt").read_text()[-3000:]
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.time()
        job.wait(timeout=120)
        took = time.time() - stopped
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    lines = (tmp_path / "err.txt").read_text().strip().splitlines()
    assert len(lines) == 1, lines
    # the stopped rank is the one that failed, wherever it stopped: between transfers (its pipeline
    # peer's P2PError names the wait) or before a collective (its peers' all-reduce timed out)
    assert re.match(r"pipetrain: error: rank 1 \(pp 0, dp_replicate 1\) failed: stuck or dead \(killed by SIGKILL\): "
                    r"rank \d \(pp \d, dp_replicate \d\) timed out first: ", lines[0]), lines[0]
    assert (re.search(rf"P2PError: rank 3 \(pp 1, dp_replicate 1\): \d+F\d+ on rank 3 waiting for the activation of "
                      rf"0F\d+ from rank 1 \(pp 0, dp_replicate 1\) timed out after {timeout_s}s: "
                      rf"rank 1 is stuck or dead",
                      lines[0])
            or lines[0].endswith(f"waited {timeout_s}s in a collective (pipeline.p2p_timeout_s bounds every wait "
                                 f"after the first step)")), lines[0]
    assert took < timeout_s + 12, took  # was timeout_s + 30
