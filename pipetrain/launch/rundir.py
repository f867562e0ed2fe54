"""The run directory before any rank starts: can we write there, and is it ours alone? (no torch)

  check_args(argv)          before Hydra composes: a run directory (hydra.run.dir=, run.name=)
                            that is a file, or that we cannot write, fails in one line instead of
                            in Hydra's log set-up (FileExistsError, "Unable to configure handler")
  check_writable(run_dir)   before launching: the run and checkpoints directories take a file
  RunLock(run_dir)          <run_dir>/.lock holds the pid and host of the run using it, and
                            .lock.rank<r> beside it each rank's (record_rank); a second run there
                            refuses in one line; a lock whose processes are all gone (same host)
                            is taken over; the process holding it takes it again freely (the CLI
                            takes it before Hydra writes into the directory, launch() again)
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

LOCK = ".lock"


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable(path: Path) -> Optional[str]:
    """Why `path` (a directory to be) cannot take our files, or None."""
    base = _nearest_existing(path)
    if not base.is_dir():
        return f"{base} is a file, not a directory"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable"
    if base == path:  # really write: a read-only mount or a full disk can pass os.access (root)
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".pipetrain-write-check-"):
                pass
        except OSError as e:
            return f"{path} is not writable ({e.strerror or e})"
    return None


def check_args(argv: Sequence[str], cwd: Optional[Path] = None) -> None:
    """One-line ValueError when the command line names a run directory we cannot use.
    Only literal values are checked (hydra.run.dir=... with ${...} is checked after composing)."""
    if "-m" in argv or "--multirun" in argv:
        return
    cwd = Path(cwd or os.getcwd())
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or "${" in value or not value:
            continue
        if key == "hydra.run.dir":
            path, knob = cwd / value, "hydra.run.dir"
        elif key == "run.name" and "/" not in value:
            path, knob = cwd / "outputs" / value, "run.name"
        else:
            continue
        why = _unwritable(path)
        if why:
            raise ValueError(f"run directory {path}: {why}: set {knob} to a directory you can write")


def check_writable(run_dir: Path, *, checkpoints: bool) -> None:
    """Before any rank starts: the run directory (and checkpoints/ when the run saves) take a file."""
    run_dir = Path(run_dir)
    for path, fix in ((run_dir, "set run.name or hydra.run.dir to a directory you can write"),
                      (run_dir / "checkpoints",
                       "make it writable, or set trainer.ckpt_every=0 trainer.ckpt_at_end=false")):
        if path.name == "checkpoints" and not checkpoints:
            continue
        why = _unwritable(path)
        if why:
            raise ValueError(f"{path}: {why}: {fix}")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on; [] where unknown (gone, or not Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _started(pid: int) -> Optional[int]:
    """When the process started (clock ticks since boot; field 22), None where unknown: with the
    pid it names one process, not whichever later reuses the number."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _alive(pid: int, started: Optional[int] = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    fields = _stat(pid)
    if fields[:1] == ["Z"]:  # ended; only its exit status waits to be read
        return False
    now = _started(pid)
    return started is None or now is None or now == started


def record_rank(run_dir: Path, rank: int) -> None:
    """A rank of the run holding <run_dir>/.lock records itself beside it (.lock.rank<r>), so that
    the lock counts as held while any process of the run is alive, not only its launcher: ranks
    that outlived a killed launcher still write checkpoints/. Rewritten by a restarted rank."""
    path = Path(run_dir) / f"{LOCK}.rank{rank}"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _started(os.getpid())}))
    tmp.replace(path)


class RunLock:
    """<run_dir>/.lock for as long as the run lasts (a context manager). Exclusive creation is the
    lock; its content ({"pid", "host", "started", "proc_start"}, and "took_over" from a gone run)
    and the ranks' records beside it (record_rank) are what a refused second run is told. It is
    stale, and taken over, only when the launcher and every recorded rank are gone. A lock that
    this very process holds is not refused: taking it again joins it, and only the first taker
    releases it."""

    def __init__(self, run_dir: Path, *, note: Callable[[str], None] = lambda text: None) -> None:
        self.path, self.note, self.held = Path(run_dir) / LOCK, note, False
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "proc_start": _started(os.getpid())}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.mine) + "\n")
        return True

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _holder(self) -> dict:
        return self._read(self.path)

    def _ranks(self) -> dict[Path, dict]:
        return {p: self._read(p) for p in sorted(self.path.parent.glob(f"{LOCK}.rank*")) if not p.name.endswith(".tmp")}

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def ours(self, record: dict) -> bool:
        """Whether a lock's record names this process (its pid, host and start)."""
        return bool(record) and all(record.get(k) == self.mine[k] for k in ("pid", "host", "proc_start"))

    def _live(self, record: dict) -> bool:
        pid = record.get("pid")
        if not isinstance(pid, int):
            return False
        return record.get("host") != self.mine["host"] or _alive(pid, record.get("proc_start"))

    def check(self) -> dict:
        """Raise the one-line refusal if a live run holds the lock; else return the holder (or {};
        this process's own record where it holds the lock)."""
        other = self._holder() if self.path.exists() else {}
        if self.ours(other):
            return other
        pid, host = other.get("pid"), other.get("host")
        fix = "wait for it, stop it, or set another run.name / hydra.run.dir"
        if self._live(other):
            where = f"run directory {self.path.parent} is in use by pid {pid} on {host} (since {other.get('started')})"
            if host == self.mine["host"]:
                raise ValueError(f"{where}: {fix}")
            raise ValueError(
                f"{where}: if that run is gone, delete {self.path}; or set another run.name / hydra.run.dir")
        live = {p.name.rsplit("rank", 1)[1]: r for p, r in self._ranks().items() if self._live(r)}
        if live:  # its launcher is gone but some of its ranks still run (and save into checkpoints/)
            ranks = ", ".join(f"rank {r} (pid {rec['pid']} on {rec.get('host')})" for r, rec in live.items())
            gone = f"its launcher pid {pid} is gone but " if isinstance(pid, int) else ""
            raise ValueError(f"run directory {self.path.parent} is in use: {gone}{ranks} still running: {fix}")
        return other  # none, unreadable, or stale: free to take

    def _forget_ranks(self) -> None:
        for path in self._ranks():
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            # also refused where .lock is gone but a rank of the run that held it is not
            if self.ours(self.check()):  # held by this process already: its first taker releases it
                return
            if self._create():
                self.held = True
                return
            other = self.check()
            pid, host = other.get("pid"), other.get("host")
            if not other and self._age() < 5.0:  # just created, not written yet: wait for its content
                time.sleep(0.25)
                continue
            # stale (its processes are gone) or unreadable: take it over; O_EXCL again decides a race
            self.note(f"run directory: took over the lock of pid {pid} on {host}, which is gone")
            self.mine["took_over"] = f"pid {pid} on {host}"
            self._forget_ranks()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        raise ValueError(f"could not lock {self.path}: another run keeps taking it; set another run.name")

    def release(self) -> None:
        # only in the process that took it (not in a child that forked with this object)
        if self.held and os.getpid() == self.mine["pid"] and self.ours(self._holder()):
            self._forget_ranks()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
