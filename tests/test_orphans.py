"""Ranks never outlive their launcher: `kill -9` of the process that started them (the `pipetrain`
launcher with its fork server, a process that spawned them, torchrun's agent) and every rank is
gone a few seconds later, instead of training on to the last step with nobody to report to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipetrain.launch.local import worker_pids

pytestmark = pytest.mark.e2e

TINY = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.device=cpu", "trainer.max_steps=100000",
        "trainer.ckpt_every=0", "trainer.ckpt_at_end=false", "logger=[jsonl]"]


def _env() -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: it only waits for its parent to read its exit status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _steps(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _wait_for_step(job: subprocess.Popen, run: Path, step: int) -> None:
    deadline = time.time() + 240
    while _steps(run) < step and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert job.poll() is None and _steps(run) >= step, "the run did not reach its second step"


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after `seconds` (none, when every one ended)."""
    deadline = time.time() + seconds
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_sigkilled_launcher_leaves_no_forked_rank(tmp_path):
    """cluster=local on CPU: the ranks are the children of the fork server, not of the launcher."""
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *TINY, "pipeline.degree=2",
                            f"hydra.run.dir={run}"], cwd=tmp_path, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_step(job, run, 2)
        ranks = worker_pids(job.pid)
        servers = [p for p in _children(job.pid) if p not in ranks]
        assert len(ranks) == 2, ranks
        # the ranks recorded themselves beside the run directory's lock (launch/rundir.py: record_rank)
        assert sorted(json.loads(p.read_text())["pid"] for p in run.glob(".lock.rank*")) == ranks
        # a SIGTERM to the whole group (scancel) reaches the fork server too: it must not end it, or its
        # ranks would die with it before they save the step (train/stop.py)
        server = next(p for p in servers if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(server, signal.SIGTERM)
        time.sleep(0.5)
        assert all(map(_alive, [server, *ranks]))
        job.kill()
        job.wait()
        assert _gone_within(ranks + servers, 10) == []
    finally:
        for pid in worker_pids(job.pid) + (ranks if "ranks" in locals() else []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        job.kill()


SPAWNING = textwrap.dedent("""
    import multiprocessing, sys, time
    from pipetrain.launch.forkserver import Inherit

    def rank(inherit):
        inherit.adopt()  # what every rank does first (launch/rank.py: local_worker)
        time.sleep(120)

    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=rank, args=(Inherit(),))
        child.start()
        print(child.pid, flush=True)
        time.sleep(120)
""")


def test_sigkilled_launcher_leaves_no_spawned_rank(tmp_path):
    """The spawn start method (NCCL ranks): the ranks are the launcher's own children."""
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING)
    job = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, text=True)
    rank = int(job.stdout.readline())
    try:
        time.sleep(3)  # the rank has imported pipetrain and adopted its launcher
        assert _alive(rank)
        job.kill()
        job.wait()
        assert _gone_within([rank], 10) == []
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.slow
def test_sigkilled_torchrun_agent_leaves_no_rank(tmp_path):
    """cluster=torchrun: torchrun starts each rank in a session of its own, out of reach of a
    signal to the agent's process group."""
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "pipetrain.cli", *TINY, "cluster=torchrun", "pipeline.degree=2",
                            f"hydra.run.dir={run}"], cwd=tmp_path, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        _wait_for_step(job, run, 2)
        ranks = _children(job.pid)
        assert len(ranks) == 2, ranks
        job.kill()
        job.wait()
        assert _gone_within(ranks, 10) == []
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        job.kill()


SERVER_FROM_A_THREAD = textwrap.dedent("""
    import multiprocessing.forkserver, os, threading, time
    from pipetrain.launch import forkserver

    if __name__ == "__main__":
        t = threading.Thread(target=lambda: (forkserver.warm(), time.sleep(2)))
        t.start()
        t.join()
        time.sleep(0.5)
        pid = multiprocessing.forkserver._forkserver._forkserver_pid
        print("alive" if os.waitpid(pid, os.WNOHANG) == (0, 0) else "dead")
""")


def test_fork_server_started_from_a_thread_outlives_the_thread(tmp_path):
    """The kernel's parent-death signal follows the thread that started a process, not the process:
    a server started from a thread that then ends must not ask for it (or it dies, with its ranks)."""
    script = tmp_path / "server_from_a_thread.py"
    script.write_text(SERVER_FROM_A_THREAD)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.stdout.strip() == "alive", res.stderr[-2000:]
