"""checkpoint.async_save=true: training goes on while the checkpoint's files are written.

DCP's async_save copies this rank's tensors to host memory (the part that blocks training) and
writes them from a background thread, coordinating over a gloo group of its own (a second
thread must not use the group the pipeline's sends and all-reduces run on). The save is
committed as a synchronous one is (train/checkpoint.py: every rank's files on disk, the manifest,
meta.json last, one rename) when the next save starts, when the run ends or stops on a signal:
until then it is a .step_*.tmp directory that no resume reads. The console reports the time
each save blocked training and the time it took in the background.
"""

from __future__ import annotations

import datetime
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from pipetrain.config import Config
from pipetrain.train.checkpoint import (
    Checkpointable, TrainState, barrier, commit_staged, prepare_staging, save_state_dict, world_rank,
)
from pipetrain.train.checkpoint_dcp import planners
from pipetrain.train.checkpoint_dirs import Note, silent, step_dir
from pipetrain.train.disk_full import one_line_if_full


@dataclass
class _Pending:
    future: Any  # a concurrent.futures.Future of DCP's background write
    tmp: Path
    state: TrainState  # the counters at the step saved
    started: float
    blocked_s: float


class AsyncSaver:
    """One per rank: at most one save in flight. Collective calls, as the synchronous save."""

    def __init__(self, config: Config, run_dir: Path, *, note: Note = silent) -> None:
        self.config, self.run_dir, self.note = config, Path(run_dir), note
        self.pending: Optional[_Pending] = None
        self.group: Optional[dist.ProcessGroup] = None

    def save(self, target: Checkpointable) -> Path:
        """Start saving target's current step; returns the directory it will be committed to."""
        self.finish()  # the previous one first: one in flight
        t0 = time.perf_counter()
        if dist.is_initialized() and self.group is None:
            # collective: every rank saves at the same steps; checkpoint.timeout_s, as the sync save's group
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=self.config.checkpoint.timeout_s))
        with one_line_if_full(target.state.step, self.run_dir, rank=world_rank()), warnings.catch_warnings():
            tmp = prepare_staging(target, self.run_dir, group=self.group)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            import torch.distributed.checkpoint as dcp

            future = dcp.async_save(save_state_dict(target, copy=True), checkpoint_id=tmp, process_group=self.group,
                                    no_dist=not dist.is_initialized(), planner=planners()[0]())
        if not isinstance(future, Future):  # newer torch: a response holding the upload future
            future = getattr(future, "upload_completion", future)
        blocked = time.perf_counter() - t0
        self.pending = _Pending(future, tmp, replace(target.state), t0, blocked)
        if world_rank() == 0:
            self.note(f"checkpoint: saving {step_dir(self.run_dir, target.state.step).name} in the background "
                      f"(blocked training {blocked:.2f} s)")
        return step_dir(self.run_dir, target.state.step)

    def finish(self) -> Optional[Path]:
        """Collective: wait for the save in flight (if any) and commit it; returns its directory."""
        if self.pending is None:
            return None
        p, self.pending = self.pending, None
        with one_line_if_full(p.state.step, self.run_dir, rank=world_rank()):  # the background write's too
            p.future.result()  # this rank's files are written (raises what the background write raised)
            barrier(self.group)  # every rank's (the background write, done, used this group: it is free)
            final = commit_staged(p.tmp, p.state, self.run_dir, self.config, note=silent, group=self.group)
        if world_rank() == 0:
            self.note(f"checkpoint: saved {final} (blocked training {p.blocked_s:.2f} s, "
                      f"{time.perf_counter() - p.started:.2f} s in all)")
        return final
