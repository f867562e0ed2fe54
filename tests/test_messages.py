"""Every message tells the truth in one line (issue #25): what a stop saved, which global rank
failed, that the disk is full, that a step was skipped. Real runs, real signals, real files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

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
                                        f"resume with trainer.resume={ckpt}"], err[-3000:]
    assert not (run / ".ranks").exists()  # rank 0 removes its stop-wait file


@pytest.mark.e2e
def test_a_full_disk_says_so_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """checkpoints/ on a 30 MB tmpfs: step 2's checkpoint (~21 MB) fits, step 4's does not. It used
    to end in ~200 lines of DCP tracebacks ('unexpected pos 704 vs 598') without the words."""
    from conftest import run_cli

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(ckpts)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        res = run_cli([*ARGS, "trainer.max_steps=4", "trainer.ckpt_every=2", "logger=[jsonl]",
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
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
