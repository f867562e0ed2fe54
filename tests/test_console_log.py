"""The console kept with the run (issue 26): `<run dir>/pipetrain.log` holds what the terminal
showed, plain; metrics.jsonl rows carry a wall-clock `time`; a typo gets one line with the
nearest name; `--version` is pipetrain's. Real processes, a real pseudo-terminal, real files."""

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import pytest

from conftest import REPO, run_cli
from pipetrain.compose import group_options
from pipetrain.runlog import LOG_FILE, ChatterFilter, PlainLog, plain

ESC = "\x1b"


@pytest.mark.pure
def test_plain_keeps_what_a_redraw_left_without_escape_codes():
    assert plain("\x1b[1mtraining\x1b[0m 1/3\r\x1b[2Kstep 1/3 loss \x1b[32m2.0\x1b[0m\r") == (0, "step 1/3 loss 2.0")
    # rich's transient bar going away: show the cursor, up one line, erase it, then the next text
    assert plain("\x1b[?25h\r\x1b[1A\x1b[2K\x1b[3m  step 3 per rank\x1b[0m") == (1, "  step 3 per rank")
    assert plain("\x1b]8;id=1;file:///x\x1b\\link\x1b]8;;\x1b\\ \x1b[3A") == (0, "link ")
    assert plain("\x1b[?25l") == (0, "") and plain("") == (0, "")


@pytest.mark.pure
def test_chatter_lines_leave_the_terminal_and_nothing_else_waits():
    f = ChatterFilter()
    # a line's start is held only while it may still become `USDT:`; a bar without a newline is not
    shown = [f.feed(b"step 1\nUS"), f.feed(b"DT:2026 profiler_start\nUSD"), f.feed(b"T:x\ntraining 1/3"),
             f.feed(b"\rtraining 2/3"), f.feed(b"\nU"), f.feed(b"sers\n")]
    assert shown == [b"step 1\n", b"", b"training 1/3", b"\rtraining 2/3", b"\n", b"Users\n"]
    f.feed(b"US")
    assert f.flush() == b"US"  # what was held at the end still reaches the terminal


@pytest.mark.pure
def test_the_log_drops_a_line_the_terminal_erased(tmp_path):
    (tmp_path / LOG_FILE).write_text("$ pipetrain\n")
    log = PlainLog(tmp_path / LOG_FILE)
    log.write([b"step 3/3 loss 1.0", b"\x1b[1mtraining\x1b[0m 3/3 steps", b"\x1b[?25h\r\x1b[1A\x1b[2Kdone: 3 steps",
               b"\x1b[?25l", b""])
    log.close()
    assert (tmp_path / LOG_FILE).read_text() == "$ pipetrain\nstep 3/3 loss 1.0\ndone: 3 steps\n\n"


@pytest.mark.pure
def test_the_line_printed_as_the_tee_stops_reaches_the_terminal_and_the_log(tmp_path, monkeypatch):
    """The last line a run prints before its tee stops is never lost (issue #44: a refused run's
    `pipetrain: error:` line was missing in 8 of 67 runs). The interleaving that lost it, forced: the
    tee's wait for data times out, and before its thread acts on that the main thread prints its
    last line and restores the stream (the thread waits for the GIL meanwhile)."""
    import select

    from pipetrain.runlog import _Stream

    terminal_r, terminal_w = os.pipe()  # the terminal the tee copies to
    fd = os.dup(terminal_w)  # the stream the tee takes over, as it takes fd 1 or 2
    (tmp_path / LOG_FILE).write_text("$ pipetrain\n")
    log = PlainLog(tmp_path / LOG_FILE)
    real_select, tee = select.select, []

    def wait_then_the_main_thread_runs(*args):
        ready = real_select(*args)
        if not ready[0] and tee and not tee[0].stopping.is_set():  # the wait timed out: the last line comes now
            os.write(fd, b"pipetrain: error: the last line\n")
            tee[0].restore()
        return ready

    monkeypatch.setattr(select, "select", wait_then_the_main_thread_runs)
    tee.append(_Stream(fd, log))
    tee[0].thread.join(timeout=10)
    monkeypatch.undo()
    tee[0].close()
    log.close()
    for end in (fd, terminal_w):
        os.close(end)
    with os.fdopen(terminal_r, "rb") as terminal:
        assert terminal.read() == b"pipetrain: error: the last line\n"
    assert (tmp_path / LOG_FILE).read_text() == "$ pipetrain\npipetrain: error: the last line\n"


def _run_on_a_terminal(args, cwd, watch):
    """The CLI with stdout and stderr on a pseudo-terminal of 120 columns, as a user runs it;
    `watch(text so far)` is called as the terminal fills. Returns (exit code, all it showed)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    shown = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            shown.extend(data)
            watch(shown.decode("utf-8", "replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=300)
    reader.join(timeout=30)
    os.close(master)
    return code, shown.decode("utf-8", "replace")


@pytest.mark.e2e
def test_a_run_on_a_terminal_keeps_its_console_plain_in_the_run_dir(tmp_path):
    run = tmp_path / "run"
    log = run / LOG_FILE
    seen_live: list[bool] = []

    def watch(text: str) -> None:  # step 1's line is in the log while the run goes on (flushed per line)
        if not seen_live and "step 1/3" in text:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "step 1/3" not in (log.read_text() if log.exists() else ""):
                time.sleep(0.05)
            seen_live.append("step 1/3" in log.read_text() and "done:" not in log.read_text())

    t0 = time.time()
    code, shown = _run_on_a_terminal(["model=sleep", "trainer.max_steps=3", "trainer.log_every=1",
                                      "trainer.ckpt_at_end=false", "profile.enabled=true", "logger=[console,jsonl]",
                                      f"hydra.run.dir={run}"], tmp_path, watch)
    t1 = time.time()
    assert code == 0, shown[-3000:]
    assert seen_live == [True]
    # the terminal stayed a terminal (rich drew colours), and Kineto's lines stayed off it
    assert ESC + "[" in shown and "USDT:" not in shown
    (done,) = [ln for ln in shown.splitlines() if "done: 3 steps" in ln]
    text = log.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("$ pipetrain model=sleep trainer.max_steps=3 ")
    assert lines[-1] == plain(done)[1] and lines[-1].startswith("done: 3 steps, loss ")
    assert ESC not in text and "\r" not in text
    assert not [ln for ln in lines if ln.startswith("training ")]  # the transient bar went, as on the terminal
    assert ([ln.split(" loss")[0] for ln in lines if re.match(r"step \d+/3 ", ln)]
            == ["step 1/3", "step 2/3", "step 3/3"])
    assert sum(ln.startswith("USDT:") for ln in lines) >= 2  # Kineto's chatter: in the log only
    assert not (run / "cli.log").exists()  # Hydra's empty job log is no longer left
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("train/loss" in r for r in rows)
    stamps = [r["time"] for r in rows]
    assert all(isinstance(s, float) for s in stamps) and t0 <= stamps[0] <= stamps[1] <= stamps[2] <= t1


@pytest.mark.e2e
def test_a_piped_run_logs_what_it_printed_and_a_failed_one_its_error(tmp_path):
    ok = run_cli(["mode=simulate", "model=sleep", "schedule=zbv", f"hydra.run.dir={tmp_path / 'ok'}"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    lines = (tmp_path / "ok" / LOG_FILE).read_text().splitlines()
    assert lines[1:] == ok.stdout.splitlines() and ok.stderr == ""  # off a terminal: byte for byte, line for line
    assert not (tmp_path / "ok" / "cli.log").exists()
    bad = run_cli(["mode=simulate", "model=gpt2", "model.n_head=5", f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    lines = (tmp_path / "bad" / LOG_FILE).read_text().splitlines()
    assert lines[1:] == bad.stderr.splitlines() and re.match(r"pipetrain: error: model\.n_embd=768 ", lines[1])


# issue #44's refused run: schedule=auto finds no layout within the memory, after printing its plan table
REFUSED = ["schedule=auto", "model=gpt2-tiny", "trainer.max_steps=2", "plan.memory_gb=0.000001", "plan.calibrate=false"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_refused_run_prints_its_error_line_every_time(tmp_path):
    """Nothing a run prints is lost, its last line included: a refused run repeated 50 times shows its plan
    table and its `pipetrain: error:` line on the terminal and in pipetrain.log every time (issue #44: the tee's
    thread could quit with them unread in its pipe, in 8 of 67 runs). Each run is the command's entry in a
    process of its own, forked from one that imported the command once (tests/_cli_runs.py)."""
    n = 50
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    res = subprocess.run([sys.executable, str(REPO / "tests" / "_cli_runs.py"), str(tmp_path), str(n), *REFUSED],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout) == [2] * n
    table = (tmp_path / "stdout0").read_text()
    assert "plan: best first" in table
    for i in range(n):
        out, err = (tmp_path / f"stdout{i}").read_text(), (tmp_path / f"stderr{i}").read_text()
        assert out == table, f"run {i} printed another plan table"
        assert err.startswith("pipetrain: error: schedule=auto: no candidate fits plan.memory_gb=1e-06 ") and \
            err.count("\n") == 1, f"run {i}'s terminal: {err!r}"
        log = (tmp_path / f"run{i}" / LOG_FILE).read_text().splitlines()
        # both streams, each whole and in its order (the two may interleave in the log)
        assert log[0].startswith("$ pipetrain schedule=auto ") and log[1:].count(err.strip()) == 1, f"run {i}'s log"
        assert [ln for ln in log[1:] if ln != err.strip()] == table.splitlines(), f"run {i}'s log"


@pytest.mark.e2e
@pytest.mark.parametrize("args, line", [
    (["trainer.max_step=10"], "trainer.max_step is not a config key; did you mean trainer.max_steps?"),
    (["model=llama-tny"], "model=llama-tny is not a model option; did you mean model=llama-tiny?"),
    (["model=llama-tny", "--help"], "model=llama-tny is not a model option; did you mean model=llama-tiny?"),
    (["-m", "mode=simulate", "schedule=zbv,zbvv"],
     "schedule=zbvv is not a schedule option; did you mean schedule=zbv?"),
    (["model=sleep", "model.f_m=1"], "model.f_m is not a config key; did you mean model.f_ms?"),
])
def test_a_typo_is_one_line_with_the_nearest_name(tmp_path, args, line):
    res = run_cli(args, cwd=tmp_path)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"pipetrain: error: {line}\n")
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a run directory


@pytest.mark.e2e
def test_an_option_with_no_near_name_lists_them_all(tmp_path):
    res = run_cli(["partition=nosuch"], cwd=tmp_path)
    assert res.returncode == 2
    options = group_options("partition")
    assert len(options) >= 5
    assert res.stderr == f"pipetrain: error: partition=nosuch is not a partition option: choose partition= one of " \
                         f"{', '.join(options)}\n"


@pytest.mark.e2e
def test_version_is_pipetrains(tmp_path):
    res = run_cli(["--version"], cwd=tmp_path)
    assert (res.returncode, res.stdout) == (0, f"pipetrain {version('pipetrain')}\n")


@pytest.mark.e2e
@pytest.mark.slow
def test_wandb_says_one_line_and_no_footer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"))  # no credentials: offline by itself
    res = run_cli(["model=mlp", "data=synthetic", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
                   "trainer.ckpt_at_end=false", "logger=[console,jsonl,wandb]", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path, env_extra=env)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.lstrip().lower().startswith("wandb")]
    assert len(said) == 1 and said[0].startswith("wandb: no credentials") and "wandb sync" in said[0], said
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))  # logged all the same
    assert said[0] in (tmp_path / "run" / LOG_FILE).read_text().splitlines()
