"""pipetrain-prepare's `--out` folder, written all at once or not at all.

The shards go into a hidden sibling, `.OUT.partial`, which is renamed to OUT only when the
whole run has succeeded (one rename: atomic within a filesystem). A failed run removes it; a
killed one (SIGKILL, a lost node) leaves it beside OUT, never inside, and the next run into the
same OUT reclaims it. A live run holds an flock on that folder (the kernel drops it when the
process ends, however it ends), which is how a run tells a live writer's folder from a dead one's.

Nothing the tool did not write is deleted: OUT may be new or empty; a non-empty OUT is replaced
only with --overwrite (as mode=export's export.overwrite), never when it is or holds a folder the
run reads from; a partial folder holding files of other names is left alone.
Imports no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from types import TracebackType
from typing import Callable, Optional, Sequence

from pipetrain.config.token_origin import RECORD
from pipetrain.files import replace_dir

# what a run writes: ShardWriter's {split}_{n:06d}.bin, and the record of the tokenizer that made them
SHARD_NAME = re.compile(rf"(train|val)_\d{{6,}}\.bin|{re.escape(RECORD)}")


def check_out(out: str, *, overwrite: bool, reads: Sequence[tuple[str, Path]]) -> Path:
    """--out as an absolute path, or a one-line ValueError when writing there could lose a file
    this tool did not create. `reads`: (what, path) of every input and the tokenizer folder.
    Looks at the directory tree only: it runs before any token is read."""
    path = Path(os.path.abspath(Path(out).expanduser()))
    if path.parent == path:
        raise ValueError(f"--out {out} is a filesystem root: name a new or empty folder, e.g. --out data/corpus")
    if path.is_symlink():
        raise ValueError(f"--out {out} is a symbolic link: name the folder itself ({path.resolve()})")
    for above in (path, *path.parents):
        if above.exists() and not above.is_dir():
            where = "is a file" if above == path else f"is inside {above}, which is a file"
            raise ValueError(f"--out {out} {where}: name a folder for the shards (new or empty)")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not held:
        return path
    for what, read in reads:
        read = Path(os.path.abspath(read))
        if read == path or path in read.parents:
            raise ValueError(f"--out {out} holds {what} ({read}): write the shards to another folder "
                             "(--overwrite never replaces a folder the run reads from)")
    if not overwrite:
        raise ValueError(f"--out {out} is not empty ({len(held)} entries, e.g. {held[0]}): pass --overwrite to "
                         "replace the folder and everything in it, or name a new or empty folder")
    return path


class PartialOut:
    """A context manager: on enter, the hidden sibling `.OUT.partial` is made (after reclaiming a
    dead run's) and locked; `install()` renames it to OUT; on an exception it is removed, with the
    parent folders the run made."""

    def __init__(self, out: Path, note: Callable[[str], None]) -> None:
        self.out = out
        self.path = out.with_name(f".{out.name}.partial")
        self.note = note
        self._fd: Optional[int] = None
        self._made: list[Path] = []  # parent folders this run created, deepest first

    def __enter__(self) -> "PartialOut":
        if self.path.exists() or self.path.is_symlink():
            self._reclaim()
        self._made = [p for p in (self.out.parent, *self.out.parent.parents) if not p.exists()]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        self._fd = os.open(self.path, os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh folder: nobody else holds it
        return self

    def __exit__(self, kind: Optional[type], value: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            if kind is not None and self.path.is_dir():
                with contextlib.suppress(ValueError, OSError):  # the run's own error is the one to show
                    _remove_shards(self.path)
                    for folder in self._made:
                        if any(folder.iterdir()):
                            break
                        folder.rmdir()
        finally:
            if self._fd is not None:
                os.close(self._fd)  # releases the lock

    def install(self) -> None:
        """Rename the partial folder to OUT. An empty OUT is replaced by the rename itself (rename(2)
        replaces an empty directory); a non-empty one (--overwrite: check_out allowed it) is moved
        aside under a fresh name first and removed after, so OUT is always whole."""
        if replace_dir(self.path, self.out):
            self.note(f"replaced {self.out} (--overwrite)")

    def _reclaim(self) -> None:
        """Remove a dead run's partial folder; a one-line error when a live run holds it or it
        holds anything the tool does not write."""
        if self.path.is_symlink() or not self.path.is_dir():
            raise ValueError(f"{self.path} is in the way of --out {self.out}'s partial folder: move it away")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"another pipetrain-prepare is writing --out {self.out} (into {self.path}): "
                                 "wait for it to end, or name another --out") from None
            _remove_shards(self.path)
        finally:
            os.close(fd)
        self.note(f"removed {self.path}: the partial output of an interrupted run")


def _remove_shards(folder: Path) -> None:
    """Delete the shards in `folder` and the folder; a one-line error, deleting nothing, when it
    holds anything else."""
    foreign = sorted(p.name for p in folder.iterdir() if not (p.is_file() and SHARD_NAME.fullmatch(p.name)))
    if foreign:
        raise ValueError(f"{folder} holds files pipetrain-prepare does not write ({', '.join(foreign[:3])}): "
                         "move them away, then run again")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
