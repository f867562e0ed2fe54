"""Automatic restart after a rank dies: how long it takes, and that the run ends where an
uninterrupted one does.

`pipetrain` (cluster=local, 2 gloo ranks, GPT-2 tiny, fp32) with launch.max_restarts=2,
trainer.max_steps=20 and trainer.ckpt_every=5; once step 7 is logged, one rank process is
SIGKILLed from outside. torch elastic restarts both workers; they resume from step 5's checkpoint
by themselves. Then the same run without the kill. Reported:
  - completed: the hurt run exited 0 after 20 steps;
  - bitwise_equal: every tensor of step 20's checkpoint (weights, AdamW moments, RNG states)
    equal to the uninterrupted run's;
  - restart_s: from the kill to the restarted group's first step logged (detect the failure, stop
    the survivor, start 2 processes, rendezvous, build, verify + load the checkpoint, one step);
  - to_message_s: from the kill to the "restarted after ..." line (events.jsonl written);
  - lost_steps: steps done twice (failed step - checkpoint step);
  - wall_s of both runs.

Usage: python bench/restart.py [--out bench/results/restart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipetrain.launch.local import worker_pids

STEPS, EVERY, KILL_AT = 20, 5, 7
ARGS = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.device=cpu", f"trainer.max_steps={STEPS}",
        f"trainer.ckpt_every={EVERY}", "logger=[console,jsonl]"]


def rows(run: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except (FileNotFoundError, ValueError):
        return []


def hurt_run(run: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *ARGS, "launch.max_restarts=2",
                            f"hydra.run.dir={run}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(rows(run)) < KILL_AT and job.poll() is None:
        time.sleep(0.01)
    victim = worker_pids(job.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter()
    seen = len(rows(run))
    restart_s = to_message_s = None
    while job.poll() is None:
        now = time.perf_counter()
        if to_message_s is None and (run / "events.jsonl").exists():
            to_message_s = now - killed
        if restart_s is None and len(rows(run)) > seen:
            restart_s = now - killed
        time.sleep(0.01)
    out, err = job.communicate()
    event = json.loads((run / "events.jsonl").read_text().splitlines()[-1]) if (run / "events.jsonl").exists() else {}
    return {"returncode": job.returncode, "wall_s": time.perf_counter() - t0, "restart_s": restart_s,
            "to_message_s": to_message_s, "event": event, "stderr_tail": err[-500:] if job.returncode else ""}


def final(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / f"step_{STEPS:06d}", tmp / f"{run.name}.pt")
    return torch.load(tmp / f"{run.name}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "restart.json"))
    args = parser.parse_args()
    env = dict(os.environ, WANDB_MODE="offline")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hurt = hurt_run(tmp / "hurt", env)
        t0 = time.perf_counter()
        ref = subprocess.run([sys.executable, "-m", "pipetrain.cli", *ARGS, f"hydra.run.dir={tmp / 'ref'}"], env=env,
                             capture_output=True, text=True)
        ref_wall = time.perf_counter() - t0
        a, b = final(tmp / "hurt", tmp), final(tmp / "ref", tmp)
        equal = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    event = hurt["event"]
    result = {
        "what": ("launch.max_restarts=2, one of 2 ranks SIGKILLed after step 7 of 20, checkpoints every 5 "
                 "(GPT-2 tiny, fp32, gloo)"),
        "completed": hurt["returncode"] == 0 and ref.returncode == 0, "bitwise_equal": equal,
        "message": event.get("text"), "restart_s": hurt["restart_s"], "to_message_s": hurt["to_message_s"],
        "lost_steps": (event.get("failed_step") or 0) - (event.get("resumed_step") or 0),
        "hurt_wall_s": hurt["wall_s"], "uninterrupted_wall_s": ref_wall,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
