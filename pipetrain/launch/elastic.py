"""cluster=local: one process per pipeline rank on this host, through torch's elastic launcher.

This is what `torchrun --standalone --nproc_per_node=P` does (c10d rendezvous on a free
localhost port, max_restarts=0), called as a library so the parent keeps the plan it
validated and gets rank 0's return value back. When a rank fails the agent stops the
others; we report the rank that failed first, from the error files the workers wrote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pipetrain.launch import forkserver
from pipetrain.launch.errors import UNFINISHED, RankFailedError, RunStopped, rank_text, read_stopped
from pipetrain.launch.forkserver import CPU_MALLOC_ENV, inherited_environ
from pipetrain.launch.rank import Entry, elastic_worker, resolve_devices

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.parallel.layout import Layout
    from pipetrain.plan import Plan


def launch_local(config: Config, plan: Plan, run_dir: Path, entry: Entry) -> dict:
    """Start the world's workers (pipeline.degree x dp degrees) running `entry`; return rank 0's result."""
    backend = resolve_devices(config).cluster.backend  # launch() decided it: the ranks get that config
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    env = CPU_MALLOC_ENV if backend == "gloo" else {}
    forkserver.warm(backend)
    with tempfile.TemporaryDirectory(prefix="pipetrain-elastic-") as logs, inherited_environ(env), \
            _quiet("torch.distributed.elastic", "torch.multiprocessing"):
        launch_config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=config.layout.world,
            run_id=f"pipetrain-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{config.cluster.master_port or 0}",  # 0: a free port
            # launch.max_restarts: the agent restarts every worker after one fails; they resume from
            # the newest verified checkpoint by themselves (train/restart.py). 0: a failure ends the run
            max_restarts=config.launch.max_restarts,
            monitor_interval=0.1, start_method=forkserver.start_method(backend), local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=logs),  # the workers' error files, removed afterwards
        )
        try:
            results = elastic_launch(launch_config, elastic_worker)(entry, config, plan, str(run_dir),
                                                                   forkserver.Inherit())
        except ChildFailedError as err:
            if read_stopped(run_dir):  # the workers alone got the signal; they saved and left (launch/rank.py)
                raise RunStopped(read_stopped(run_dir) or {}) from None
            # the agent gives up only when launch.max_restarts restarts are spent: the line says so
            raise root_cause(error_records(Path(logs)), err.failures, run_dir, layout=config.layout,
                             restarts=config.launch.max_restarts) from None
        except SignalException as err:  # this process got SIGTERM / SIGINT; the agent passed it on
            from pipetrain.train.stop import wait_for_stop  # the ranks may outlive the agent's wait

            wait_for_stop(run_dir)
            raise RunStopped(read_stopped(run_dir) or {"signal": err.sigval.name, "step": "?", "checkpoint": None}
                             ) from None
    return results[0]


def error_records(log_dir: Path) -> dict[int, dict]:
    """Every worker's error file of the last attempt, by rank: DefaultLogsSpecs writes
    <log_dir>/<run_id>_*/attempt_<n>/<local rank>/error.json (one node: local rank = rank). The
    earlier attempts' (launch.max_restarts) are about failures the restarts got past."""
    attempts: dict[int, dict[int, dict]] = {}
    for path in log_dir.glob("*/attempt_*/*/error.json"):
        try:
            message = json.loads(path.read_text()).get("message")
            attempt = int(path.parent.parent.name.removeprefix("attempt_"))
        except (OSError, ValueError):
            continue
        if isinstance(message, dict) and path.parent.name.isdigit():
            attempts.setdefault(attempt, {})[int(path.parent.name)] = message
    return attempts[max(attempts)] if attempts else {}


# A rank's error that says a peer went away (gloo's words, and runtime/comm.py's), or that it left
# because its step could not end after the agent's SIGTERM (train/stop.py): not a cause.
LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|connection to .+ was lost|" + re.escape(UNFINISHED),
                  re.IGNORECASE)


def root_cause(records: dict[int, dict], failures: dict[int, ProcessFailure], run_dir: Optional[Path] = None, *,
               layout: Optional[Layout] = None, restarts: int = 0) -> RankFailedError:
    """The error that came first. The agent reports one failed worker, whichever it noticed
    first, often a peer that only lost its connection; every rank that raised wrote an error file
    with the time in ns (pipetrain.launch.errors.record_error), and the earliest is the cause, unless
    it only says a peer went away (LOST) and some rank of the layout wrote none: then that rank,
    killed by a signal, is. Without any the agent's report is all there is. `restarts`: the run
    used up launch.max_restarts restarts (the line says so)."""
    timed = {r: m for r, m in records.items() if "time_ns" in m.get("extraInfo", {})}
    first = min(timed, key=lambda r: (int(timed[r]["extraInfo"]["time_ns"]), r)) if timed else None
    silent = [r for r in range(layout.world if layout else 0) if r not in records]
    if first is not None and silent and LOST.search(str(timed[first].get("message", ""))):
        # the first error is a lost connection, and a rank left none: that rank died first (a
        # signal; under data parallel its pipeline's and its replicas' peers all report it)
        rank, callstack = silent[0], None
        failure = failures.get(rank)
        how = f"killed by {signal.Signals(-failure.exitcode).name}" if failure and failure.exitcode < 0 else \
            "ended without an error of its own (killed by a signal?)"
        message = f"{how}; {rank_text(first, layout)} lost its connection first: {timed[first].get('message', '')}"
    elif first is not None:
        rank = first
        message, callstack = str(timed[rank].get("message", "")), timed[rank]["extraInfo"].get("py_callstack")
    else:
        rank, failure = min(failures.items())
        message = failure.message if isinstance(failure.message, str) else f"exit code {failure.exitcode}"
        if isinstance(failure.message, dict):
            message = str(failure.message.get("message", message))
        callstack = None
    path = None
    if callstack and run_dir is not None and Path(run_dir).is_dir():
        path = Path(run_dir) / f"error_rank{rank}.txt"
        path.write_text(callstack)
    return RankFailedError(rank, (message.strip().splitlines() or ["failed"])[0], path, layout=layout,
                           restarts=restarts)


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """The agent logs every worker's exit and traceback; the one-line error says what matters."""
    known = [n for n in logging.root.manager.loggerDict if any(n.startswith(f"{name}.") for name in names)]
    loggers = [logging.getLogger(name) for name in (*names, *known)]  # torch sets levels on its children too
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
