"""Timestamps inside one executor step, cheap enough to take around every action.

CPU: the host timer (`time.perf_counter`). GPU: a CUDA event recorded on the current stream
per mark, all read once after the step's single synchronize, so timing adds no per-action
synchronisation and measures when the GPU reached each point (kernels run asynchronously to
the host; an event recorded after a receive's wait completes when the stream got the data).

Every time is relative to the step's mark 0 on the rank's own clock. Ranks are never put on
one axis by a host clock (hosts disagree by milliseconds under NTP, and on GPU the host's
time says when work was queued, not run): the executor marks the end of the step's closing
loss all-reduce, a moment every rank shares, and metrics/measure.py aligns on that mark.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


class StepClock:
    def __init__(self, device: torch.device, *, host_clock: Callable[[], float] = time.perf_counter) -> None:
        """`host_clock`: seconds on an origin of its own (the CPU marks read it); any other host's
        clock, with another origin, measures the same step alike."""
        self.cuda = device.type == "cuda"
        self.host_clock = host_clock
        self._marks: list[Any] = []

    def start(self) -> None:
        """The step's origin: mark 0."""
        self._marks.clear()
        self.mark()

    def mark(self) -> int:
        """Take a timestamp now; returns its index for `resolve`."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(self.host_clock())
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
