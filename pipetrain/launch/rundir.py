"""The run directory before any rank starts: can we write there, and is it ours alone? (no torch)

  check_args(argv)          before Hydra composes: a run directory (hydra.run.dir=, run.name=)
                            that is a file, or that we cannot write, fails in one line instead of
                            in Hydra's log set-up (FileExistsError, "Unable to configure handler")
  check_writable(run_dir)   before launching: the run and checkpoints directories take a file
  RunLock(run_dir)          <run_dir>/.lock holds the pid and host of the run using it; a second
                            run there refuses in one line; a lock whose process is gone (same
                            host) is taken over
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
                      (run_dir / "checkpoints", "make it writable, or set trainer.ckpt_every=0 trainer.ckpt_at_end=false")):
        if path.name == "checkpoints" and not checkpoints:
            continue
        why = _unwritable(path)
        if why:
            raise ValueError(f"{path}: {why}: {fix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    """<run_dir>/.lock for as long as the run lasts (a context manager). Exclusive creation is the
    lock; its content ({"pid", "host", "started"}) is what a refused second run is told."""

    def __init__(self, run_dir: Path, *, note: Callable[[str], None] = lambda text: None) -> None:
        self.path, self.note, self.held = Path(run_dir) / LOCK, note, False
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.mine) + "\n")
        return True

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def check(self) -> dict:
        """Raise the one-line refusal if a live run holds the lock; else return the holder (or {})."""
        other = self._holder() if self.path.exists() else {}
        pid, host = other.get("pid"), other.get("host")
        if not isinstance(pid, int) or (host == self.mine["host"] and not _alive(pid)):
            return other  # none, unreadable, or stale: free to take
        where = f"run directory {self.path.parent} is in use by pid {pid} on {host} (since {other.get('started')})"
        if host == self.mine["host"]:
            raise ValueError(f"{where}: wait for it, stop it, or set another run.name / hydra.run.dir")
        raise ValueError(f"{where}: if that run is gone, delete {self.path}; or set another run.name / hydra.run.dir")

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            if self._create():
                self.held = True
                return
            other = self.check()
            pid, host = other.get("pid"), other.get("host")
            if not other and self._age() < 5.0:  # just created, not written yet: wait for its content
                time.sleep(0.25)
                continue
            # stale (its process is gone) or unreadable: take it over; O_EXCL again decides a race
            self.note(f"run directory: took over the lock of pid {pid} on {host}, which is gone")
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        raise ValueError(f"could not lock {self.path}: another run keeps taking it; set another run.name")

    def release(self) -> None:
        if self.held and self._holder().get("pid") == self.mine["pid"]:
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
