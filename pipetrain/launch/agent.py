"""cluster=local: one process per rank on this host, started and watched by the launcher (no torch).

What `torchrun --standalone` does, without importing torch in the launching process (its ~2 s of
CPU would be paid beside the ranks' own import, on the run's critical path on a small machine):
the ranks fork from a warm server (launch/forkserver.py) with the torchrun variables set (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_ERROR_FILE,
...), so a rank runs the same code under cluster=local as under torchrun. Rank 0 hosts the
rendezvous store on a port the kernel picks and publishes it in a file of the attempt's folder
(launch/rank.py), unless cluster.master_port names one.

When a rank fails the others get FAILED_GRACE_S to leave by themselves (and write their errors),
then as long again after SIGTERM, then SIGKILL; launch.max_restarts starts a new attempt of every
rank (they resume from the run's newest verified checkpoint, train/restart.py), else the rank that
failed first is reported in one line, from the error files the ranks wrote. A signal to the
launcher (SIGTERM, SIGINT, SIGHUP) is passed to every rank, which save their step and leave
(train/stop.py); the launcher reports where to resume.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import re
import signal
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from pipetrain.launch import forkserver
from pipetrain.launch.env import STEP_FILE, STORE_FILE
from pipetrain.launch.errors import (ENDED, STOPPED_EXIT, UNFINISHED, RankFailedError, RunStopped, rank_text,
                                     read_stopped, wait_for_stop)
from pipetrain.launch.forkserver import CPU_MALLOC_ENV, inherited_environ

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.parallel.layout import Layout
    from pipetrain.plan import Plan

Entry = Union[Callable[["Config", "Plan", Path], dict], str]  # a function, or "module:function" (no import here)

FAILED_GRACE_S = 3.0  # a failed rank's peers: time to leave by themselves, then again after SIGTERM
STOP_GRACE_S = 30.0  # ranks stopping on a signal: time to finish the step, save and leave, then SIGKILL
ENDED_FIRST = "ended_first"
RESULT = "result.pkl"  # rank 0's return value, in its attempt's folder


def launch_local(config: Config, plan: Plan, run_dir: Path, entry: Entry) -> dict:
    """Start the world's ranks (pipeline.degree x dp degrees) running `entry`; return rank 0's result."""
    backend = config.cluster.backend  # launch() decided it (launch/devices.py): the ranks get that config
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    forkserver.warm(backend, compile=config.trainer.compile)
    restarts = config.launch.max_restarts
    run_id = f"pipetrain-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="pipetrain-ranks-") as tmp, \
            inherited_environ(CPU_MALLOC_ENV if backend == "gloo" else {}), _Signals() as signals:
        logs = Path(tmp)
        for attempt in range(restarts + 1):
            folder = logs / f"attempt_{attempt}"
            folder.mkdir()
            ranks = _start(config, plan, run_dir, entry, folder, attempt, run_id)
            outcome, exits = _watch(ranks, signals, folder)
            if outcome == "ok":
                return pickle.loads((folder / RESULT).read_bytes())
            if outcome == "signal":
                wait_for_stop(run_dir)  # the ranks may outlive their fork server (a signal to the process group)
                raise RunStopped(read_stopped(run_dir) or {"signal": signal.Signals(signals.received or 15).name,
                                                            "step": "?", "checkpoint": None})
            if outcome == "stopped":  # the ranks alone got the signal; they saved and left (train/stop.py)
                raise RunStopped(read_stopped(run_dir) or {"signal": "SIGTERM", "step": "?", "checkpoint": None})
            if attempt == restarts:
                # gave up only when launch.max_restarts restarts are spent: the line says so
                raise root_cause(error_records(logs), run_dir, layout=config.layout, restarts=restarts, exits=exits)
    raise AssertionError("unreachable")


def _start(config: Config, plan: Plan, run_dir: Path, entry: Entry, folder: Path, attempt: int,
           run_id: str) -> list[Any]:
    """Every rank of one attempt, started (forked from the warm server on CPU, spawned for NCCL)."""
    world = config.layout.world
    ctx = multiprocessing.get_context(forkserver.start_method(config.cluster.backend))
    common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(config.cluster.master_port or 0), "TORCHELASTIC_RUN_ID": run_id,
              "TORCHELASTIC_RESTART_COUNT": str(attempt),
              "TORCHELASTIC_MAX_RESTARTS": str(config.launch.max_restarts),
              STEP_FILE: str(folder.parent / "step_in_progress")}
    if not config.cluster.master_port:  # 0: rank 0 binds a free port and says which here
        common[STORE_FILE] = str(folder / "store_port")
    ranks = []
    for rank in range(world):
        (folder / str(rank)).mkdir()  # a rank without an error file in it left none (train/restart.py)
        variables = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
                     "TORCHELASTIC_ERROR_FILE": str(folder / str(rank) / "error.json")}
        process = ctx.Process(target=_rank_process, name=f"rank{rank}",
                              args=(entry, config, plan, str(run_dir), forkserver.Inherit(), variables,
                                    str(folder / RESULT) if rank == 0 else None))
        process.start()
        ranks.append(process)
    return ranks


def _rank_process(entry: Entry, config: Config, plan: Plan, run_dir: str, inherit: forkserver.Inherit,
                  variables: dict[str, str], result_file: Optional[str]) -> None:
    """A rank's first frame (imported by name here, so the launcher never imports launch/rank.py's torch)."""
    from pipetrain.launch.rank import local_worker

    local_worker(entry, config, plan, run_dir, inherit, variables, result_file)


def _watch(ranks: list[Any], signals: _Signals, folder: Path) -> tuple[str, dict]:
    """Wait for one attempt's ranks: ('ok', {}) when all ended well; ('stopped', ...) when they stopped on a
    signal of their own; ('signal', ...) when this process got one (passed on to them); ('failed', exits)
    when one failed, the others stopped: every rank's exit code, and under ENDED_FIRST those that had
    ended by themselves when the failure was seen (also written to the attempt's folder, ENDED, where a
    restarted rank 0 reads which rank failed: train/restart.py)."""
    live = {p.sentinel: p for p in ranks}
    while live:
        if signals.received is not None:
            _send(ranks, signals.received)
            _reap(ranks, STOP_GRACE_S, final=signal.SIGKILL)
            return "signal", {}
        for sentinel in wait(list(live), timeout=0.1):
            live.pop(sentinel).join()
        failed = {i: p.exitcode for i, p in enumerate(ranks) if p.exitcode not in (0, None)}
        if failed and all(code == STOPPED_EXIT for code in failed.values()):
            _reap(ranks, STOP_GRACE_S, final=signal.SIGKILL)  # its peers are still saving the same step
            return "stopped", {}
        if failed:
            (folder / ENDED).write_text(json.dumps(failed))
            _reap(ranks, FAILED_GRACE_S, final=signal.SIGTERM)
            _reap(ranks, FAILED_GRACE_S, final=signal.SIGKILL)
            return "failed", {ENDED_FIRST: failed, **{i: p.exitcode for i, p in enumerate(ranks)}}
    return "ok", {}


def _reap(ranks: list[Any], grace_s: float, *, final: int) -> None:
    """Wait up to grace_s for every rank to end, then send `final` to those left (and, for SIGKILL, reap them)."""
    deadline = time.monotonic() + grace_s
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    _send(ranks, final)
    if final == signal.SIGKILL:
        for p in ranks:
            p.join()


def _send(ranks: list[Any], signum: int) -> None:
    for p in ranks:
        if p.exitcode is None and p.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)


class _Signals:
    """While inside (main thread only): SIGTERM, SIGINT and SIGHUP to this process are noted, not fatal;
    the watch loop passes the signal on to the ranks."""

    WANTED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._note) for sig in self.WANTED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)


def error_records(log_dir: Path) -> dict[int, dict]:
    """Every rank's error file of the last attempt, by rank: <log_dir>/attempt_<n>/<rank>/error.json
    (launch/errors.py: record_error). The earlier attempts' (launch.max_restarts) are about failures
    the restarts got past."""
    attempts: dict[int, dict[int, dict]] = {}
    for path in Path(log_dir).glob("**/attempt_*/*/error.json"):
        try:
            message = json.loads(path.read_text()).get("message")
            attempt = int(path.parent.parent.name.removeprefix("attempt_"))
        except (OSError, ValueError):
            continue
        if isinstance(message, dict) and path.parent.name.isdigit():
            attempts.setdefault(attempt, {})[int(path.parent.name)] = message
    return attempts[max(attempts)] if attempts else {}


# A rank's error that says a peer went away (gloo's words, and runtime/comm.py's), or that it left
# because its step could not end after the launcher's SIGTERM (train/stop.py): not a cause.
LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|connection to .+ was lost|" + re.escape(UNFINISHED),
                  re.IGNORECASE)
# A wait that timed out, in gloo's words (a collective whose peer never came: after the first step
# the groups time out after pipeline.p2p_timeout_s, parallel/timeouts.py) or runtime/comm.py's (a
# transfer): a symptom too, of a stuck or dead rank.
TIMED_OUT = re.compile(r"timed out waiting (\d+) ?ms|timed out after [\d.]+s", re.IGNORECASE)
_SOURCE = re.compile(r"\[[^\]\s]*\.(cc|cpp|h|hpp):\d+\] ")  # gloo's "[.../pair.cc:553] " prefix


def root_cause(records: dict[int, dict], run_dir: Optional[Path] = None, *, layout: Optional[Layout] = None,
               restarts: int = 0, exits: Optional[dict] = None) -> RankFailedError:
    """The error that came first. Every rank that raised wrote an error file with the time in ns
    (launch/errors.py: record_error), and the earliest is the cause, unless it only says a peer went
    away (LOST) or that a wait timed out (TIMED_OUT) and some rank of the layout wrote none: then that
    rank, dead or stuck until it was killed, is (those that ended by themselves, ENDED_FIRST, first).
    Without any file: the first rank that ended badly, by its exit code. `restarts`: the run used up
    launch.max_restarts restarts (the line says so); `exits`: every rank's exit code where known (a
    negative one is a signal's)."""
    exits = exits or {}
    first_ended = exits.get(ENDED_FIRST, {})
    timed = {r: m for r, m in records.items() if "time_ns" in m.get("extraInfo", {})}
    first = min(timed, key=lambda r: (int(timed[r]["extraInfo"]["time_ns"]), r)) if timed else None
    # ranks without an error file; those that ended by themselves (not by the launcher's kill) first
    silent = sorted((r for r in range(layout.world if layout else 0) if r not in records),
                    key=lambda r: (first_ended.get(r) is None, r))
    said = _SOURCE.sub("", str(timed[first].get("message", ""))) if first is not None else ""
    waited = TIMED_OUT.search(said)
    callstack = None
    if first is not None and silent and (LOST.search(said) or waited):
        # the first error is a lost connection or a wait that timed out, and a rank left none:
        # that rank died or hung first (and was killed; under data parallel its pipeline's and
        # its replicas' peers all report it)
        rank = silent[0]
        code = int(exits.get(rank, 0) or 0)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else \
            "ended without an error of its own (killed by a signal?)"
        if waited:
            how = how if code < 0 else "left no error of its own"
            if waited.group(1):  # gloo's collective: say what the wait was
                said = (f"waited {int(waited.group(1)) / 1000:g}s in a collective (pipeline.p2p_timeout_s bounds "
                        f"every wait after the first step)")
            message = f"stuck or dead ({how}): {rank_text(first, layout)} timed out first: {said}"
        else:
            message = f"{how}; {rank_text(first, layout)} lost its connection first: {said}"
    elif first is not None:
        rank = first
        message, callstack = said, timed[rank]["extraInfo"].get("py_callstack")
    else:
        bad = first_ended or {r: c for r, c in exits.items() if isinstance(r, int) and c}
        rank = min(bad) if bad else 0
        code = int(bad.get(rank, 0) or 0)
        message = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    path = None
    if callstack and run_dir is not None and Path(run_dir).is_dir():
        path = Path(run_dir) / f"error_rank{rank}.txt"
        try:
            path.write_text(callstack)
        except OSError:  # a full disk (often why the rank failed): the one line is all there is
            path.unlink(missing_ok=True)
            path = None
    return RankFailedError(rank, (message.strip().splitlines() or ["failed"])[0], path, layout=layout,
                           restarts=restarts)
