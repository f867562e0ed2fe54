"""A checkpoint save that ran out of disk: one line that says so, and nothing left half-written.

Without it a full disk ends a run in every rank's DCP traceback ("CheckpointException ranks:
dict_keys([0, 1])", "RuntimeError: ... unexpected pos 704 vs 598"), often without the words
"no space left", and with the step's staging directory left to fill the disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

# a save ran out of space: its staged files are removed, the checkpoints before it untouched
from pipetrain.files import DiskFull
from pipetrain.train.checkpoint_dirs import list_checkpoints, step_dir

__all__ = ["DiskFull", "disk_full", "full_error", "one_line_if_full"]


def disk_full(err: BaseException, directory: Path) -> bool:
    """Whether `err` is, or wraps, ENOSPC / EDQUOT, or `directory`'s file system has (next to)
    nothing left. DCP raises one CheckpointException on every rank that carries each rank's own
    exception (`failures`: rank -> (exception, traceback)), and torch.save's zip writer turns a short
    write into "RuntimeError: ... unexpected pos 704 vs 598", without the errno."""
    try:
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < 1 << 20:
            return True
    except OSError:
        pass
    stack, seen = [err], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        # torch.save's short write: checked by message, since statvfs alone races with rank 0, which may
        # already have removed the staged files (freeing the space) when a peer looks (seen under load)
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
    return False


def full_error(step: int, run_dir: Path, *, rank: int) -> DiskFull:
    """The one-line error; rank 0 first removes the step's staged files (what the disk held before
    the save is left as it was)."""
    final = step_dir(run_dir, step)
    if rank == 0:
        shutil.rmtree(final.with_name(f".{final.name}.tmp"), ignore_errors=True)
    before = [p for s, p in list_checkpoints(final.parent) if s != step]
    kept = f"the previous checkpoint {before[-1]} is intact" if before else "there is no earlier checkpoint"
    return DiskFull(f"checkpoint of step {step}: no space left on device in {final.parent}; its partial files were "
                    f"removed and {kept}: free space there, or lower checkpoint.keep_last")


@contextlib.contextmanager
def one_line_if_full(step: int, run_dir: Path, *, rank: int) -> Iterator[None]:
    """Around a save of `step` (written, staged or committed, in the foreground or the background):
    a full disk becomes full_error's one line; anything else passes through."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException (not an Exception)
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not disk_full(e, step_dir(run_dir, step).parent):
            raise
        raise full_error(step, run_dir, rank=rank) from None
