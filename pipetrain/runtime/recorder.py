"""What an executor step records beside the interpretation: timing, trace marks, memory.

The executor (runtime/executor.py) only interprets a rank's actions; at fixed points it
tells its recorder what happened, and the recorder turns that into the StepResult:

  begin_step()                  the step starts: mark 0 (on GPU the allocator's peak is reset)
  begin(index)                  step `index` of the rank's list starts (an F&B pair: two parts)
  range(what)                   a `PP:<what>` torch.profiler range around an action or a
                                REDUCE_GRAD, named as torch.distributed.pipelining names its own
                                (only while `profile_ranges`: the trainer's captured steps)
  part_done()                   a part ended: its end mark; reductions seen done since
  sent(msg) / received(msg, t0) a cross-rank send handed to the transport; a receive that waited
                                from mark t0 (`mark()`) to now (metrics/measure.py: the bubble)
  saving(s, m)                  around a forward: counts the bytes autograd saves for (s, m)
  freed(s, m)                   W or BW dropped what the forward of (s, m) saved
  reduce_issued(s) / reduce_done(s)  a stage's gradient reduction started / was seen complete
  end_compute() / end_step()    after the last action and its sends / after every reduction
  synced()                      the step's closing loss all-reduce ended (every rank alike)
  collective(...) / node(...)   (not called by the executor) an all-to-all or cp transfer, a node
                                of a node-by-node stage, reported through runtime/collectives.py,
                                where a measured step installs its recorder from begin_step to end_step
  result(loss, peak_recv)       the StepResult

`Recorder` records nothing but the profiler ranges: an unmeasured step (the trainer measures
its logged steps only, `Executor.measure`) pays a method call at each point and returns the loss
alone (and uninstalls any collectives sink). `StepRecorder` measures: times come from
runtime/clock.py (perf_counter on CPU, CUDA events on GPU, read once after the step), each
action's start and end, the collectives inside it, each part of an F&B
pair, and the time each receive kept the action waiting; a reduction's "seen done" is an upper
bound of its end: the first part boundary after it completed, or the final wait.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Optional, Sequence

import torch

from pipetrain.compat import untraced
from pipetrain.metrics.records import ActionTiming, CollectiveEvent, CommEvent
from pipetrain.runtime import collectives
from pipetrain.runtime.clock import StepClock
from pipetrain.runtime.grad_reduce import GradReducer
from pipetrain.runtime.step_result import SavedBytes, StepResult
from pipetrain.schedules.p2p import Message

_NOTHING = contextlib.nullcontext()  # stateless: one for every unrecorded range and forward


class Recorder:
    """An unmeasured step: profiler ranges when asked, nothing else."""

    def __init__(self) -> None:
        # record_function costs a few microseconds even with no profiler running: off by default
        self.profile_ranges = False

    def range(self, what: object) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(f"PP:{what}") if self.profile_ranges else _NOTHING

    def _nothing(self, *args: object) -> None:
        """What an unmeasured step does at each point (the module docstring lists them)."""

    begin = part_done = sent = received = freed = _nothing
    reduce_issued = reduce_done = end_compute = end_step = synced = _nothing

    def begin_step(self) -> None:
        collectives.install(None)  # a measured step that raised may have left its recorder there

    def mark(self) -> int:
        return 0

    def saving(self, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        return _NOTHING

    def result(self, loss: Optional[float], peak_recv: dict[int, int]) -> StepResult:
        return StepResult(loss=loss, peak_recv_buffer_bytes=peak_recv)


class _Saving:
    """A forward's saved-tensor hooks; on exit its bytes join the live activations."""

    __slots__ = ("rec", "key", "counter", "hooks")

    def __init__(self, rec: "StepRecorder", key: tuple[int, int]) -> None:
        self.rec, self.key, self.counter = rec, key, SavedBytes()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(untraced(self.counter.pack), self.counter.unpack)

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)
        self.rec.kept(self.key, self.counter.bytes)


class StepRecorder(Recorder):
    """A measured step: every mark the StepResult's timings, comm events and memory come from."""

    def __init__(self, device: torch.device, step_texts: Sequence[str], reducer: Optional[GradReducer]) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.device = device
        self.clock = StepClock(device)  # replaceable: a clock with another host timer measures alike
        self._texts = step_texts
        self._reducer = reducer  # polled between parts while its reductions are in flight

    def begin_step(self) -> None:
        self._spans: list[list[int]] = []  # per step, its marks at the start and after each part
        self._index = self._part = 0  # the step (and part of an F&B pair) being run
        self._comm: list[tuple[str, Message, int, int, int, int]] = []  # (direction, msg, step, part, mark, mark)
        self._reduce_marks: dict[int, int] = {}  # stage -> mark when its reduction was issued
        self._reduce_seen: dict[int, int] = {}  # stage -> mark when it was seen done
        self._act_bytes: dict[tuple[int, int], int] = {}  # (stage, microbatch) alive -> bytes saved
        self._live = self._peak_bytes = self._peak_sets = 0
        self._compute_end = self._end = 0
        self._sync: Optional[int] = None
        # (group, label, bytes, step, mark issued, mark waited from, mark arrived): runtime/collectives.py
        self._colls: list[tuple[str, str, int, int, int, int, int]] = []
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clock.start()
        collectives.install(self)

    def begin(self, index: int) -> None:
        self._index, self._part = index, 0
        self._spans.append([self.clock.mark()])

    def part_done(self) -> None:
        self._spans[-1].append(self.clock.mark())
        self._part += 1
        if len(self._reduce_seen) < len(self._reduce_marks):  # reductions in flight
            for s in self._reducer.poll():  # type: ignore[union-attr]
                self.reduce_done(s)

    def mark(self) -> int:
        return self.clock.mark()

    def sent(self, msg: Message) -> None:
        mark = self.clock.mark()
        self._comm.append(("send", msg, self._index, self._part, mark, mark))

    def received(self, msg: Message, since: int) -> None:
        self._comm.append(("recv", msg, self._index, self._part, since, self.clock.mark()))

    def collective(self, group: str, label: str, nbytes: int, started: int, waited: int) -> None:
        self._colls.append((group, label, nbytes, self._index, started, waited, self.clock.mark()))

    def node(self, label: str, started: int) -> None:
        end = self.clock.mark()
        self._colls.append(("node", label, 0, self._index, started, end, end))

    def saving(self, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        return _Saving(self, (stage, microbatch))

    def kept(self, key: tuple[int, int], nbytes: int) -> None:
        # summed: node-level execution saves a forward's tensors node by node (one `saving` per node)
        self._act_bytes[key] = self._act_bytes.get(key, 0) + nbytes
        self._live += nbytes
        self._peak_sets = max(self._peak_sets, len(self._act_bytes))
        self._peak_bytes = max(self._peak_bytes, self._live)

    def freed(self, stage: int, microbatch: int) -> None:
        self._live -= self._act_bytes.pop((stage, microbatch))

    def reduce_issued(self, stage: int) -> None:
        self._reduce_marks[stage] = self.clock.mark()

    def reduce_done(self, stage: int) -> None:
        if stage not in self._reduce_seen:
            self._reduce_seen[stage] = self.clock.mark()

    def end_compute(self) -> None:
        self._compute_end = self.clock.mark()

    def end_step(self) -> None:
        self._end = self.clock.mark()
        collectives.install(None)

    def synced(self) -> None:
        self._sync = self.clock.mark()

    def result(self, loss: Optional[float], peak_recv: dict[int, int]) -> StepResult:
        times = self.clock.resolve()
        timings, comm = self._timings(times)
        end = times[self._end]
        return StepResult(
            loss=loss,
            timings=timings,
            comm=comm,
            step_ms=end,
            sync_ms=times[self._sync] if self._sync is not None else None,
            peak_activation_sets=self._peak_sets,
            peak_activation_bytes=self._peak_bytes,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else None,
            peak_recv_buffer_bytes=peak_recv,
            reduce_exposed_ms=end - times[self._compute_end],
            reduce_issued_ms={s: times[m] for s, m in self._reduce_marks.items()},
            reduce_done_ms={s: times[m] for s, m in self._reduce_seen.items()},
        )

    def _timings(self, times: list[float]) -> tuple[list[ActionTiming], list[CommEvent]]:
        """Marks -> per-step timings (span, receive waits, compute per part) and comm events."""
        waits: dict[tuple[int, int], float] = defaultdict(float)  # (step index, part) -> ms blocked
        comm = []
        for direction, msg, index, part, m0, m1 in self._comm:
            t0, t1 = times[m0], times[m1]
            if direction == "recv":
                waits[(index, part)] += t1 - t0
            peer = msg.src if direction == "recv" else msg.dst
            comm.append(CommEvent(direction, msg.kind, msg.stage, msg.microbatch, peer, index, t0, t1))
        inside: dict[int, list[CollectiveEvent]] = defaultdict(list)  # step index -> its collectives
        for group, label, nbytes, index, m0, m1, m2 in sorted(self._colls, key=lambda c: c[4]):  # by issue
            inside[index].append(CollectiveEvent(group, label, nbytes, times[m0], times[m1], times[m2]))
        timings = []
        for index, (text, marks) in enumerate(zip(self._texts, self._spans)):
            t = [times[i] for i in marks]
            part_wait = [waits[(index, p)] for p in range(len(t) - 1)]
            part_ms = tuple(t[p + 1] - t[p] - part_wait[p] for p in range(len(t) - 1))
            timings.append(ActionTiming(index, text, t[0], t[-1], sum(part_wait), part_ms, tuple(inside[index])))
        return timings, comm
