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
from pipetrain.launch.errors import ENDED, UNFINISHED, RankFailedError, RunStopped, rank_text, read_stopped
from pipetrain.launch.forkserver import CPU_MALLOC_ENV, inherited_environ
from pipetrain.launch.rank import STOPPED_EXIT, Entry, elastic_worker, resolve_devices

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.parallel.layout import Layout
    from pipetrain.plan import Plan


def launch_local(config: Config, plan: Plan, run_dir: Path, entry: Entry) -> dict:
    """Start the world's workers (pipeline.degree x dp degrees) running `entry`; return rank 0's result."""
    backend = resolve_devices(config).cluster.backend  # launch() decided it: the ranks get that config
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    env = CPU_MALLOC_ENV if backend == "gloo" else {}
    forkserver.warm(backend, compile=config.trainer.compile)
    with tempfile.TemporaryDirectory(prefix="pipetrain-elastic-") as logs, inherited_environ(env), \
            _quiet("torch.distributed.elastic", "torch.multiprocessing"), _short_grace(Path(logs)) as exits:
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
                             restarts=config.launch.max_restarts, exits=exits) from None
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
# A wait that timed out, in gloo's words (a collective whose peer never came: after the first step
# the groups time out after pipeline.p2p_timeout_s, parallel/timeouts.py) or runtime/comm.py's (a
# transfer): a symptom too, of a stuck or dead rank.
TIMED_OUT = re.compile(r"timed out waiting (\d+) ?ms|timed out after [\d.]+s", re.IGNORECASE)
_SOURCE = re.compile(r"\[[^\]\s]*\.(cc|cpp|h|hpp):\d+\] ")  # gloo's "[.../pair.cc:553] " prefix


def _plain(message: str) -> str:
    return _SOURCE.sub("", message)


def root_cause(records: dict[int, dict], failures: dict[int, ProcessFailure], run_dir: Optional[Path] = None, *,
               layout: Optional[Layout] = None, restarts: int = 0,
               exits: Optional[dict[int, int]] = None) -> RankFailedError:
    """The error that came first. The agent reports one failed worker, whichever it noticed
    first, often a peer that only lost its connection; every rank that raised wrote an error file
    with the time in ns (pipetrain.launch.errors.record_error), and the earliest is the cause, unless
    it only says a peer went away (LOST) or that a wait timed out (TIMED_OUT) and some rank of
    the layout wrote none: then that rank, dead or stuck until it was killed, is. Without any the
    agent's report is all there is. `restarts`: the run used up launch.max_restarts restarts (the
    line says so); `exits`: every worker's exit code where known (the agent reports only the first
    failed one's; a negative one is a signal's), and under ENDED_FIRST those of the workers that
    ended before the launcher stopped the others."""
    timed = {r: m for r, m in records.items() if "time_ns" in m.get("extraInfo", {})}
    first = min(timed, key=lambda r: (int(timed[r]["extraInfo"]["time_ns"]), r)) if timed else None
    # ranks without an error file; those that ended by themselves (not by the launcher's kill) first
    silent = sorted((r for r in range(layout.world if layout else 0) if r not in records),
                    key=lambda r: ((exits or {}).get(ENDED_FIRST, {}).get(r) is None, r))
    said = _plain(str(timed[first].get("message", ""))) if first is not None else ""
    waited = TIMED_OUT.search(said)
    if first is not None and silent and (LOST.search(said) or waited):
        # the first error is a lost connection or a wait that timed out, and a rank left none:
        # that rank died or hung first (and was killed; under data parallel its pipeline's and
        # its replicas' peers all report it)
        rank, callstack = silent[0], None
        failure = failures.get(rank)
        code = failure.exitcode if failure else int((exits or {}).get(rank, 0))
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
        rank, failure = min(failures.items())
        message = failure.message if isinstance(failure.message, str) else f"exit code {failure.exitcode}"
        if isinstance(failure.message, dict):
            message = str(failure.message.get("message", message))
        callstack = None
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


# When a worker fails, torch.multiprocessing's ProcessContext.join (which torch elastic's agent
# polls) waits 30 s for the others to leave on SIGTERM before it kills them, all of it for a
# stopped or hung rank, which cannot act on SIGTERM (nor can one blocked in a collective: Python
# runs signal handlers between bytecodes): a SIGSTOPped rank was reported 30 s after the
# survivors' own pipeline.p2p_timeout_s. The others get FAILED_GRACE_S to leave by themselves
# (and write their errors), then as long again after SIGTERM. Without the failed rank they cannot
# finish a step, so no save is cut short. A rank that ended with STOPPED_EXIT did not fail: it
# stopped on a signal after its step's checkpoint (train/stop.py), and its peers, still saving the
# same checkpoint, keep torch's 30 s.
FAILED_GRACE_S = 3.0
ENDED_FIRST = "ended_first"


@contextlib.contextmanager
def _short_grace(logs: Path) -> Iterator[dict]:
    """While inside: ProcessContext.join with FAILED_GRACE_S. Yields the exit codes by local rank
    (one node: the rank) of the last attempt that failed, and under ENDED_FIRST those of the workers
    that had ended when the failure was seen, before any was stopped: the ones that died (or
    raised) by themselves. Those are also written into that attempt's log folder (ENDED), where a
    restarted rank 0 reads which rank failed (train/restart.py)."""
    from multiprocessing.connection import wait

    from torch.multiprocessing.spawn import ProcessContext

    join = ProcessContext.join

    def short(self: ProcessContext, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> bool:
        if grace_period is None and self.sentinels:
            ready = wait(list(self.sentinels), timeout=timeout)  # what join would find; it pops them itself
            if not ready:
                return False
            ended = {self.sentinels[s]: self.processes[self.sentinels[s]].exitcode for s in ready}
            failed = {i: c for i, c in ended.items() if c not in (0, None)}
            grace_period = None if failed and all(c == STOPPED_EXIT for c in failed.values()) else FAILED_GRACE_S
            if failed:
                exits.clear()
                exits[ENDED_FIRST] = failed
                attempts = sorted(logs.glob("*/attempt_*"), key=lambda d: int(d.name.removeprefix("attempt_")))
                if attempts:
                    (attempts[-1] / ENDED).write_text(json.dumps(failed))
            timeout = 0
        try:
            return join(self, timeout, grace_period)
        except Exception:  # every worker has ended: how
            exits.update({i: p.exitcode for i, p in enumerate(self.processes) if p.exitcode is not None})
            raise

    exits: dict = {}
    ProcessContext.join = short  # type: ignore[method-assign]
    try:
        yield exits
    finally:
        ProcessContext.join = join  # type: ignore[method-assign]


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
