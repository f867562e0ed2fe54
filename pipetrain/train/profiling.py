"""profile.enabled=true: a torch.profiler capture of chosen steps, one trace per rank.

The profiler starts before step `profile.start_step` and stops after `profile.steps` steps;
while it runs the executor wraps every action in a `PP:<action>` range (runtime/executor.py),
so the operators (and on CUDA the kernels) sit under the pipeline action that ran them. Each
rank writes `<run dir>/profile/rank<r>.json` (Chrome trace; opens in https://ui.perfetto.dev,
as trace.json does). On CUDA, `profile.memory_snapshot=true` also records the caching
allocator's history over the same steps (torch.cuda.memory._record_memory_history) and dumps
`profile/rank<r>_memory.pickle` for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pipetrain.compat import dump_memory_snapshot, record_memory_history
from pipetrain.config.profile import ProfileConfig
from pipetrain.runtime.executor import Executor

PROFILE_DIR = "profile"


class StepProfiler:
    """Starts and stops torch.profiler around the chosen steps of one rank."""

    def __init__(self, cfg: ProfileConfig, *, rank: int, device: torch.device, run_dir: Path,
                 executor: Executor, note: Callable[[str], None]) -> None:
        self.cfg, self.rank, self.device, self.executor, self.note = cfg, rank, device, executor, note
        self.dir = Path(run_dir) / PROFILE_DIR
        self._prof: Optional[profile] = None
        self._range: Optional[record_function] = None
        self._snapshot = cfg.memory_snapshot and device.type == "cuda"

    def before(self, step: int) -> None:
        """Step `step` (counted from 1) is about to run."""
        if not self.cfg.captures(step):
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                 with_stack=self.cfg.with_stack, profile_memory=self.cfg.profile_memory)
            if self._snapshot:
                record_memory_history(1_000_000)
            self._prof.start()
            self.executor.profile_ranges = True
        self._range = record_function(f"step {step}")
        self._range.__enter__()

    def after(self, step: int) -> None:
        """Step `step` has run (optimizer included); the last captured one writes the files."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and not self.cfg.captures(step + 1):
            self._stop()

    def close(self) -> None:
        """At the end of the run (or on an error): stop a capture still running, keeping what it has."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._stop()

    def _stop(self) -> None:
        assert self._prof is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.stop()
        self.executor.profile_ranges = False
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.json"
        self._prof.export_chrome_trace(str(path))
        self._prof = None
        if self._snapshot:
            dump_memory_snapshot(str(self.dir / f"rank{self.rank}_memory.pickle"))
            record_memory_history(None)
        last = self.cfg.start_step + self.cfg.steps - 1
        steps = f"step {last}" if self.cfg.steps == 1 else f"steps {self.cfg.start_step}-{last}"
        extra = " and rank<r>_memory.pickle (pytorch.org/memory_viz)" if self._snapshot else ""
        self.note(f"profile: {steps} -> {self.dir}/rank<r>.json{extra} (open in ui.perfetto.dev)")
