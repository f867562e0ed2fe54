"""The checkpoint phase's collectives: their own gloo group, and the resume's hashing spread over the ranks.

Why a group of its own: every collective of the default group runs under its timeout, which on
NCCL a watchdog enforces by aborting the job (launch/rank.py: 300 s or pipeline.p2p_timeout_s).
A checkpoint's slow parts are file work: DCP writing and reading, hashing every byte before a
resume (12 bytes a parameter: ~100 GB for an 8B model), deleting old checkpoints on a shared
filesystem. While one rank does them, the others wait; they wait here, in a gloo group with
checkpoint.timeout_s, never in an NCCL collective.

Why spread the hashing: rank 0 alone would read the whole checkpoint while every other rank
waits. Here rank 0 still decides which checkpoint (its listing of the directory is the one every
rank loads: ranks listing it themselves could disagree while another job commits a save), but each
time it needs a checkpoint's bytes checked, every rank hashes its `share` of the files and one
all_gather_object gives everyone the first damaged file, by name, as one process would find it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from pipetrain.train.checkpoint_dirs import Files, Note, check_order, hash_damage, resolve_resume, sha256, share, silent

DEFAULT_TIMEOUT_S = 1800.0  # config/run.py: CheckpointConfig.timeout_s


class CheckpointGroup:
    """One per trainer: the gloo group of the checkpoint phase, created on first use (a collective:
    every rank first uses it at the same call, the first resume or save)."""

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None

    def get(self, timeout_s: Optional[float] = None) -> Optional[dist.ProcessGroup]:
        """The group (None without torch.distributed: one process needs none)."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            seconds = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
        return self._group


def _check_share(path: Path, files: Files, group: Optional[dist.ProcessGroup],
                 read: Callable[[Path], str]) -> Optional[str]:
    """Collective: this rank hashes its share of `files`; the first damaged one over all ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    names = share(files, world)[rank]
    mine = hash_damage(path, {n: files[n] for n in names}, read=read)
    found: list[Any] = [None] * world
    dist.all_gather_object(found, mine, group=group)
    bad = [f for f in found if f is not None]
    return min(bad, key=lambda f: check_order(f[0]))[1] if bad else None


def pick(want: Optional[str], run_dir: Path, *, restarted: bool = False, group: Optional[dist.ProcessGroup] = None,
         note: Note = silent, read: Callable[[Path], str] = sha256) -> Optional[Path]:
    """Collective over `group`: the checkpoint to resume, the same on every rank (None: start fresh),
    its bytes checked with the hashing spread over the ranks; raises the one-line ValueError of
    trainer.resume on every rank. restarted: the run directory's newest good checkpoint first.
    `read`: a file's sha256 (hex)."""

    def resolve(check_bytes=None) -> Optional[Path]:
        by = {"deep": True, "note": note, "check_bytes": check_bytes}
        found = resolve_resume("auto", run_dir, **by) if restarted else None
        return found or resolve_resume(want, run_dir, **by)

    if not dist.is_initialized():
        return resolve(lambda path, files: _first(hash_damage(path, files, read=read)))
    if dist.get_rank(group) != 0:
        return _follow(group, read)

    def check_bytes(path: Path, files: Files) -> Optional[str]:
        dist.broadcast_object_list(["check", str(path), dict(files)], group=group, group_src=0)
        return _check_share(path, files, group, read)

    box: list[Any] = ["done", None, None]
    try:
        box[1] = resolve(check_bytes)
    except ValueError as e:
        box[2] = str(e)
    except Exception as e:  # the others must not wait for a check that never comes
        dist.broadcast_object_list(["failed", None, f"{type(e).__name__}: {e}"], group=group, group_src=0)
        raise
    dist.broadcast_object_list(box, group=group, group_src=0)
    if box[2] is not None:
        raise ValueError(box[2])
    return box[1]


def _follow(group: Optional[dist.ProcessGroup], read: Callable[[Path], str]) -> Optional[Path]:
    """Every rank but 0: hash a share of each checkpoint rank 0 asks about, until it says which one."""
    while True:
        box: list[Any] = [None, None, None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        kind, path, payload = box
        if kind == "check":
            _check_share(Path(path), payload, group, read)
        elif kind == "failed":
            raise RuntimeError(f"rank 0 failed while picking the checkpoint to resume: {payload}")
        elif payload is not None:
            raise ValueError(payload)
        else:
            return None if path is None else Path(path)


def _first(found: Optional[tuple[str, str]]) -> Optional[str]:
    return None if found is None else found[1]
