"""End-to-end faults through the `pipetrain` command: named runs that find their checkpoints again
after the whole job was killed, the run-directory lock, writability checked before any rank
starts, and the last bad inputs, each a one-line message (real subprocesses, real files)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from pipetrain.launch.local import worker_pids

pytestmark = pytest.mark.e2e

TINY = ["model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4", "trainer.eval_every=0",
        "trainer.log_every=1", "trainer.device=cpu"]


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode != 0, res.stdout[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def test_bom_csv_is_read(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_bytes("\ufeff0F0,0F1,0BW0,0BW1\n".encode("utf-8"))  # Excel's UTF-8 with a byte-order mark
    res = run_cli(["mode=simulate", "model=sleep", "pipeline.degree=1", "pipeline.microbatches=2", "schedule=custom",
                   f"schedule.path={csv}", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "r" / "simulate.json").read_text())["microbatches"] == 2


@pytest.mark.parametrize("case", ["run dir is a file", "run name is a file", "cache dir is a file", "unknown key",
                                  "path with a built-in schedule", "empty csv", "directory as schedule.path",
                                  "p2p timeout below 1 ms", "model larger than host memory"])
def test_bad_inputs_are_one_line(tmp_path, case):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "taken").write_text("x")
    (tmp_path / "empty.csv").write_text("# only a comment\n\n")
    sim = ["mode=simulate", "model=sleep", f"hydra.run.dir={tmp_path / 'r'}"]
    args, env, needle = {
        "run dir is a file": (["mode=simulate", f"hydra.run.dir={tmp_path / 'a_file'}"], {}, "is a file"),
        "run name is a file": (["mode=simulate", "run.name=taken"], {}, "set run.name"),
        "cache dir is a file": (["mode=simulate", "partition=profile", f"hydra.run.dir={tmp_path / 'r'}"],
                                {"PIPETRAIN_CACHE_DIR": str(tmp_path / "a_file")}, "PIPETRAIN_CACHE_DIR="),
        "unknown key": ([*sim, "+some_unknown_key=1"], {}, "unknown config key some_unknown_key"),
        "path with a built-in schedule": ([*sim, f"schedule.path={tmp_path / 'empty.csv'}"], {},
                                          "schedule.path is only read by schedule=custom"),
        "empty csv": ([*sim, "schedule=custom", f"schedule.path={tmp_path / 'empty.csv'}"], {}, "holds no schedule"),
        "directory as schedule.path": ([*sim, "schedule=custom", f"schedule.path={tmp_path}"], {}, "is a directory"),
        "p2p timeout below 1 ms": ([*sim, "pipeline.p2p_timeout_s=0.000001"], {}, "p2p_timeout_s must be >= 0.001"),
        # 70B x 16 bytes of fp32 training state: more than any CPU machine here holds
        "model larger than host memory": (["model=llama3.1-70b", "trainer.device=cpu", "pipeline.degree=2",
                                           "data.seq_len=64", f"hydra.run.dir={tmp_path / 'r'}"], {},
                                          "GB of host memory for its weights, gradients and AdamW state"),
    }[case]
    line = one_line_error(run_cli(args, cwd=tmp_path, env_extra=env))
    assert line.startswith("pipetrain: error: ") and needle in line, line


def test_unwritable_checkpoints_found_before_any_rank_starts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    line = one_line_error(run_cli(["mode=train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"], cwd=tmp_path))
    assert "checkpoints is a file" in line and "trainer.ckpt_at_end=false" in line
    assert not (run / "metrics.jsonl").exists()  # no rank started
    # the same run without checkpoints does not need that directory
    res = run_cli(["mode=train", *TINY, "trainer.max_steps=1", "trainer.ckpt_at_end=false", "logger=[jsonl]",
                   f"hydra.run.dir={run}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


def test_second_run_in_a_locked_directory_refuses(tmp_path):
    from pipetrain.launch.rundir import RunLock

    run = tmp_path / "run"
    with RunLock(run):  # this test process is the first run
        line = one_line_error(run_cli(["mode=train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"],
                                      cwd=tmp_path))
    assert f"in use by pid {os.getpid()} on {socket.gethostname()}" in line, line
    assert not (run / ".lock").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("extra", [[], ["schedule=auto"]], ids=["train", "schedule=auto"])
def test_refused_run_writes_nothing_into_the_live_run(tmp_path, extra):
    """Hydra writes .hydra/ and its job log before the task starts; a run the lock refuses must not
    rewrite the live run's (nor leave the planner's files there)."""
    from pipetrain.launch.rundir import RunLock

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text(f"the live run's {name}\n")
    (run / "cli.log").write_text("the live run's log\n")
    os.utime(run / ".hydra" / "config.yaml", (1_000_000_000, 1_000_000_000))

    def files() -> dict[str, tuple[bytes, float]]:
        return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime) for p in run.rglob("*") if p.is_file()}

    with RunLock(run):  # this test process is the live run
        before = files()
        line = one_line_error(run_cli(["mode=train", *TINY, "trainer.max_steps=1", *extra, f"hydra.run.dir={run}"],
                                      cwd=tmp_path))
        assert f"in use by pid {os.getpid()}" in line, line
        assert files() == before


def _written(cwd: Path, run: Path) -> dict[str, object]:
    """What a run wrote into `run`, each file's bytes but for what differs between two runs of one command
    anywhere: the directory's path (hydra.yaml, the log), the log's start time, and the measured timings
    (metrics.jsonl and summary.json keep their keys and their train/ values: losses differ between seeds)."""
    out: dict[str, object] = {}
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        name, text = str(path.relative_to(run)), path.read_text().replace(str(cwd), "<cwd>")
        if name == "pipetrain.log":
            text = re.sub(r"  # \S+\n", "\n", text, count=1)
        if name in ("metrics.jsonl", "summary.json"):
            rows = [json.loads(text)] if name == "summary.json" else [json.loads(ln) for ln in text.splitlines()]
            out[name] = [(sorted(r), {k: v for k, v in r.items() if k.startswith("train/")}) for r in rows]
        else:
            out[name] = text
    return out


@pytest.mark.slow
def test_two_launches_of_one_run_name_at_once_leave_the_winners_files(tmp_path):
    """Two runs of one run.name started together, their seeds differing so that a file of the refused one would
    show: the one that takes the lock leaves what it writes alone (its .hydra/ included), the other is refused
    in one line and writes nothing there (issue #44: it was refused 5-10 s in, after writing its command, tables
    and simulation files there, and the winner's .hydra/config.yaml ended with its seed in 3 of 5 tries)."""
    cmd = [sys.executable, "-m", "pipetrain.cli", "mode=train", *TINY, "trainer.max_steps=1",
           "trainer.ckpt_at_end=false", "logger=[jsonl]", "run.name=both"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    (tmp_path / "pair").mkdir()
    procs = {seed: subprocess.Popen([*cmd, f"trainer.seed={seed}"], cwd=tmp_path / "pair", env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in (1, 2)}
    ends = {seed: (p.communicate(timeout=300), p.returncode) for seed, p in procs.items()}
    winners = [seed for seed, (_, code) in ends.items() if code == 0]
    assert len(winners) == 1, ends
    (winner,), (loser,) = winners, {1, 2} - set(winners)
    (out, err), code = ends[loser]
    run = tmp_path / "pair" / "outputs" / "both"
    assert (code, out) == (2, ""), err[-2000:]
    assert err.count("\n") == 1 and err.startswith(
        f"pipetrain: error: run directory {run} is in use by pid {procs[winner].pid} on {socket.gethostname()} (since ")
    assert err.endswith("): wait for it, stop it, or set another run.name / hydra.run.dir\n"), err
    # the winner alone: the same command, in a directory of its own (a name as long: the log wraps paths alike)
    (tmp_path / "solo").mkdir()
    res = run_cli([*cmd[3:], f"trainer.seed={winner}"], cwd=tmp_path / "solo")
    assert res.returncode == 0, res.stderr[-2000:]
    alone = _written(tmp_path / "solo", tmp_path / "solo" / "outputs" / "both")
    assert f"seed: {winner}\n" in alone[".hydra/config.yaml"] and ".hydra/hydra.yaml" in alone  # type: ignore[operator]
    assert _written(tmp_path / "pair", run) == alone


def test_stale_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process has ended
    (run / ".lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "earlier"}))
    res = run_cli(["mode=train", *TINY, "trainer.max_steps=1", "trainer.ckpt_at_end=false", "logger=[console,jsonl]",
                   f"hydra.run.dir={run}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"took over the lock of pid {gone.pid}" in res.stdout + res.stderr
    assert f"took over the lock of pid {gone.pid}" in (run / "pipetrain.log").read_text()  # taken before the tee began
    assert not (run / ".lock").exists()  # released at the end


def test_lock_of_a_gone_launcher_is_kept_while_a_rank_of_its_run_lives(tmp_path):
    """The launcher was SIGKILLed but one of its ranks still runs (and saves into checkpoints/): the
    same command with trainer.resume=auto refuses in one line naming that rank, and touches nothing."""
    run = tmp_path / "run"
    run.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        proc_start = int(Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        host = socket.gethostname()
        (run / ".lock").write_text(json.dumps({"pid": gone.pid, "host": host, "started": "earlier"}))
        (run / ".lock.rank0").write_text(json.dumps({"pid": gone.pid, "host": host}))
        (run / ".lock.rank1").write_text(json.dumps({"pid": rank.pid, "host": host, "proc_start": proc_start}))
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        line = one_line_error(run_cli(["mode=train", *TINY, "trainer.max_steps=1", "trainer.resume=auto",
                                       f"hydra.run.dir={run}"], cwd=tmp_path))
        assert (f"launcher pid {gone.pid} is gone but rank 1 (pid {rank.pid} on {host}) still running" in line
                and "wait for it, stop it" in line), line
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    finally:
        rank.kill()
        rank.wait()
    # the same pid, started anew (its number reused by another process), does not hold the lock
    (run / ".lock.rank1").write_text(json.dumps({"pid": os.getpid(), "host": host, "proc_start": 1}))
    res = run_cli(["mode=train", *TINY, "trainer.max_steps=1", "trainer.ckpt_at_end=false", "logger=[jsonl]",
                   f"hydra.run.dir={run}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not list(run.glob(".lock*"))  # taken over, then released with its ranks' records


def test_unnamed_runs_never_share_a_directory(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "pipetrain.cli", "mode=simulate", "model=sleep",
                               "sim.timeline=false"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()[-2000:]
    runs = sorted(p.parent for p in (tmp_path / "outputs").glob("*/*/simulate.json"))
    assert len(runs) == 3, runs


def _running(pid: int) -> bool:
    try:  # a zombie has ended: it only waits for its parent to read its exit status
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _step_files(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*/meta.json"))


@pytest.mark.slow
def test_named_run_resumes_after_its_launcher_was_killed(tmp_path):
    """`pipetrain run.name=NAME trainer.resume=auto ...`, its launcher alone killed (SIGKILL) after
    the first checkpoint: no rank outlives it (launch/parent.py), and the same command again takes
    over the lock, resumes from that checkpoint and finishes with the uninterrupted run's losses."""
    cmd = [sys.executable, "-m", "pipetrain.cli", "mode=train", *TINY, "run.name=long", "trainer.resume=auto",
           "trainer.max_steps=24", "trainer.ckpt_every=3", "logger=[console,jsonl]"]
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    run = tmp_path / "outputs" / "long"
    deadline = time.time() + 240
    while not _step_files(run) and time.time() < deadline and job.poll() is None:
        time.sleep(0.2)
    ranks = worker_pids(job.pid)
    assert len(ranks) == 2, ranks
    job.kill()  # the launcher only
    job.wait()
    deadline = time.time() + 10
    while any(map(_running, ranks)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, ranks)), f"ranks {ranks} outlived their launcher"
    saved = [int(p.parent.name[5:]) for p in _step_files(run)]
    assert saved and saved[-1] < 24
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {run.resolve() / 'checkpoints' / f'step_{saved[-1]:06d}'} at step {saved[-1]}" in res.stdout
    assert "took over the lock" in res.stdout  # the killed launcher's lock
    assert _step_files(run)[-1].parent.name == "step_000024"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the steps logged after the checkpoint and redone: one row each
    assert [r["step"] for r in rows] == list(range(1, 25))
    # the losses of the uninterrupted run, step for step (issue 25: resumes "with the uninterrupted losses")
    ref = [c if c != "run.name=long" else "run.name=ref" for c in cmd if c != "trainer.resume=auto"]
    res = subprocess.run(ref, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = [json.loads(line) for line in (tmp_path / "outputs" / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in want]


def test_a_rerun_of_a_named_run_resumes_and_never_refuses_to_overwrite(tmp_path):
    """trainer.resume=auto is the default (issue #44): the same command with the same run.name resumes
    from the run's newest checkpoint instead of starting at step 1 and overwriting it; resume=never
    refuses in one line, before any rank, and touches nothing."""
    base = ["model=mlp", "run.name=mine", "sim.timeline=false", "trainer.eval_every=0"]
    first = run_cli([*base, "trainer.max_steps=2"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = tmp_path / "outputs" / "mine" / "checkpoints" / "step_000002"
    stamp = (saved / "meta.json").stat().st_mtime_ns
    again = run_cli([*base, "trainer.max_steps=3"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"checkpoint: resumed from {saved} at step 2" in again.stdout and "done: 3 steps (resumed at step 2)" in \
        again.stdout, again.stdout[-2000:]
    never = run_cli([*base, "trainer.max_steps=3", "trainer.resume=never"], cwd=tmp_path)
    assert one_line_error(never) == (
        f"pipetrain: error: trainer.resume=never starts fresh, but {saved.parent} holds 2 checkpoint(s) (newest "
        f"step_000003) it would overwrite: use a new run.name, or trainer.resume=auto to continue from the newest")
    assert (saved / "meta.json").stat().st_mtime_ns == stamp and sorted(p.name for p in saved.parent.iterdir()) == \
        ["step_000002", "step_000003"]
