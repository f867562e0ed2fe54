"""Writing a file or a folder so that a crash or a kill mid-write leaves either the old one or the
new one whole, never a torn one: the new one is made beside it, then a rename (atomic within one
filesystem) puts it in place."""

from __future__ import annotations

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
