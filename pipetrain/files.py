"""Writing a file or a folder so that a crash or a kill mid-write leaves either the old one or the
new one whole, never a torn one: the new one is made beside it, then a rename (atomic within one
filesystem) puts it in place. A line appended to a log (metrics.jsonl) is written whole or not at
all: a write the disk cuts short is taken back."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(done: Path, out: Path) -> bool:
    """Rename the finished folder `done` to `out`, so `out` is always whole: an existing `out` is
    moved aside under a fresh name first and removed after (a symlink: the link itself is removed,
    not the folder it names). Returns whether `out` held anything before."""
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    held = out.is_dir() and not out.is_symlink() and any(out.iterdir())
    if out.is_symlink():
        out.unlink()
    elif out.exists():
        out.rename(old)
    done.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return held


class DiskFull(RuntimeError):
    """A file could not be written for want of space (a checkpoint's save, a log's line): one line
    that says which and where; what was written before is whole."""


class AppendFile:
    """A file opened for appending whole lines (metrics.jsonl, events.jsonl): each `write` lands
    whole or not at all. A write the disk cuts short (ENOSPC midway) is truncated back to where it
    began, and raises one line naming the file (DiskFull when out of space), so the file never ends
    in a torn line that a later row would continue."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str, *, what: str) -> None:
        """Append `text` (`what` it is, for the error: "step 5's row")."""
        data, at = text.encode(), os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as err:
            try:
                os.ftruncate(self.fd, at)
            except OSError:
                pass
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"{self.path}: no space left on device: {what} was not written (the rows before it "
                               f"are whole): free space in {self.path.parent}") from None
            raise OSError(err.errno, f"{self.path}: {what} was not written ({err.strerror}); the rows before it "
                                     f"are whole") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
