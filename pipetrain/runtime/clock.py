"""Timestamps inside one executor step, cheap enough to take around every action.

CPU: `time.perf_counter`. GPU: a CUDA event recorded on the current stream per mark, all
read once after the step's single synchronize, so timing adds no per-action synchronisation
and measures when the GPU reached each point (kernels run asynchronously to the host; an
event recorded after a receive's wait completes when the stream got the data).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self.t0_wall = 0.0

    def start(self) -> None:
        """The step's origin: mark 0, and the wall clock that aligns ranks (time.time())."""
        self._marks.clear()
        self.t0_wall = time.time()
        self.mark()

    def mark(self) -> int:
        """Take a timestamp now; returns its index for `resolve`."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def resolve(self) -> list[float]:
        """Every mark as ms since mark 0 (on GPU: waits for the stream once)."""
        if not self._marks:
            return []
        if self.cuda:
            self._marks[-1].synchronize()
            first = self._marks[0]
            return [0.0] + [first.elapsed_time(e) for e in self._marks[1:]]
        t0 = self._marks[0]
        return [(t - t0) * 1e3 for t in self._marks]
