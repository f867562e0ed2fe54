"""The one interpreter of a rank's action list.

It knows nothing about schedule names. Where an input comes from, where an output
goes, which stage computes the loss, whether a neighbour is local or remote: all of it
comes from the schedule's placement. Per action:

  F(s, m)    input = the microbatch (first stage of its chain), the local output of
             prev(s), or the received activation; run the stage; on the chain's last
             stage compute loss / M (so gradients are the mean over microbatches);
             otherwise hand the output to next(s).
  B(s, m)    input gradient only (runtime/backward.py); keep what W needs; send it back.
  W(s, m)    weight gradients from what B kept.
  BW(s, m)   both at once.
  F&B        its forward, then its backward (on one CPU stream they cannot overlap; the
             simulator's sim.fb_overlap models the overlap DualPipe gets on GPUs).

Under data parallel the schedule carries `{stage}REDUCE_GRAD` marks (schedules/reduce.py):
there the stage's gradient reduction is started (runtime/grad_reduce.py), and after the
last action the executor waits for all of them; that wait is the step's exposed reduce time.
When each was issued and seen done is kept per stage (the trace's reduction rows); "seen
done" is an upper bound of its end: the first action boundary after it completed, or the final wait.

After the last action, the summed loss is all-reduced so every rank (rank 0 logs it)
holds the mean loss of the step (over every pipeline's microbatches under data parallel).
All ranks leave it at one moment: its mark (`sync_ms`) puts them on one axis, not host clocks.
Inputs and targets move to the device once per step, pinned and non-blocking (runtime/batch.py).

Mixed precision (`compute_dtype`, e.g. bf16 for trainer.precision=bf16): parameters and
their gradients stay fp32; every stage runs under torch.autocast, and a floating-point
output is cast to compute_dtype before it goes to the next stage, by P2P or by local
hand-off, so activations and, through the cast's autograd node, their gradients cross in
compute_dtype (the node turns the returning gradient back into the producer's dtype).
Receive buffers are in compute_dtype for floating-point boundaries (train/pipeline.py). The
loss is fp32 (autocast runs cross-entropy and MSE in fp32), summed and all-reduced in fp64.

Every training step is timed (runtime/clock.py: perf_counter on CPU, CUDA events on GPU with
no per-action synchronisation): each action's start and end, each part of an F&B pair, and the
time each receive kept the action waiting (metrics/measure.py: the measured bubble).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from pipetrain.metrics.records import ActionTiming, CommEvent
from pipetrain.runtime.step_result import SavedBytes, StepResult
from pipetrain.runtime.batch import counted_targets, to_device
from pipetrain.runtime.backward import WeightGradWork, backward_full, backward_input, backward_weight
from pipetrain.runtime.clock import StepClock
from pipetrain.runtime.comm import P2P
from pipetrain.runtime.grad_reduce import GradReducer
from pipetrain.runtime.stage_protocol import Stage
from pipetrain.schedules.ir import Action, Op, Schedule
from pipetrain.schedules.p2p import Message, build_plan, forward_plan, needed_by, sent_by


class Executor:
    """Runs one rank's part of a schedule on its stage modules."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: Mapping[int, Stage],
        *,
        comm: Optional[P2P],
        recv_buffer: Optional[Callable[[Message], torch.Tensor]] = None,
        device: torch.device | str = "cpu",
        loss_group: Optional[dist.ProcessGroup] = None,
        lookahead: int = 1,
        reducer: Optional[GradReducer] = None,
        compute_dtype: Optional[torch.dtype] = None,
    ) -> None:
        pl = schedule.placement
        want = set(pl.stages_of(rank))
        if set(stages) != want:
            raise ValueError(f"rank {rank} must hold stages {sorted(want)}, got {sorted(stages)}")
        if comm is None and schedule.num_ranks > 1:
            raise ValueError("a pipeline of several ranks needs a P2P transport")
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.comm, self.recv_buffer, self.device = comm, recv_buffer, torch.device(device)
        self.loss_group = loss_group
        # The point-to-point plans (pure; validated before any process started): training, and
        # the forward-only pass of evaluate().
        self._plan = build_plan(schedule, rank, lookahead=lookahead)
        self._eval_plan = forward_plan(self._plan)
        # Per action, worked out once (not per action run): the message it receives and the one it
        # sends (None: local or none), and per step its text for timings and error messages.
        self._needs = dict(zip(self._plan.parts, self._plan.waits))  # the plan has them already
        self._sends = {a: sent_by(a, schedule, rank) for a in self._plan.parts}
        self._step_texts = [str(step) for step in schedule.steps[rank]]
        fs = [a for a in schedule.actions(rank) if a.op is Op.F]  # whose input (a chain's start) / target (its end) it reads
        self._reads = ({a.microbatch for a in fs if pl.prev_stage(a.stage) is None},
                       {a.microbatch for a in fs if pl.next_stage(a.stage) is None})
        self.reducer = reducer
        self._reduces_at: dict[int, list[int]] = defaultdict(list)  # boundary -> stages reduced there
        if reducer is not None:
            for b, red in (schedule.reduces[rank] if schedule.reduces else ()):
                self._reduces_at[b].append(red.stage)
            if not self._reduces_at:
                raise ValueError("a gradient reducer needs a schedule with REDUCE_GRAD marks (schedules/reduce.py)")
        self._forward_only = False
        self.compute_dtype = compute_dtype  # None: the parameters' dtype throughout; else autocast to it
        self.clock = StepClock(self.device)  # replaceable: a clock with another host timer measures alike
        self._recording = False  # inside step(): sends and receives are timed
        # profile.enabled: every action a `PP:<action>` torch.profiler range (the trainer sets it
        # for the captured steps only; record_function costs a few microseconds even unprofiled)
        self.profile_ranges = False
        self._index = self._part = 0  # the step (and part of an F&B pair) being run

    def close(self) -> None:
        """Release what outlives a step: the point-to-point transport's threads (in-order mode)."""
        if self.comm is not None:
            self.comm.close()

    # ---- one optimizer step's worth of microbatches ---------------------------------
    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Run every action of this rank once; `microbatches[m]` is (input, target) of microbatch m."""
        self._reset(microbatches)
        if self.comm is not None:
            self.comm.begin(self._plan, self.recv_buffer)
        if self.reducer is not None:
            self.reducer.begin()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        clock, spans = self.clock, []  # spans: per step, its marks at the start and after each part
        clock.start()
        self._recording = True
        boundary = 0  # index of the next atomic action: where the plan issues communication
        try:
            for index, step in enumerate(self.schedule.steps[self.rank]):
                self._index, marks, text = index, [clock.mark()], self._step_texts[index]
                for part, action in enumerate(step.parts()):
                    self._part = part
                    self._issue(boundary)
                    with self._range(action):
                        self._run(action, text)
                    boundary += 1
                    marks.append(clock.mark())
                    if len(self._reduce_done) < len(self._reduce_marks):  # reductions in flight
                        self._poll_reductions()
                spans.append(marks)
            self._issue(boundary)
            if self.comm is not None:
                self.comm.finish()
            compute_end = clock.mark()
            if self.reducer is not None:
                self.reducer.finish(self._reduction_done)
            end = clock.mark()
        finally:
            self._recording = False
        assert not self._ctx and not self._wstore, "validated schedule left work behind"
        loss, sync = self._mean_loss(mark=True)
        times = clock.resolve()
        timings, comm = self._timings(spans, times)
        cuda = self.device.type == "cuda"
        return StepResult(
            loss=loss,
            timings=timings,
            comm=comm,
            step_ms=times[end],
            sync_ms=times[sync] if sync is not None else None,
            peak_activation_sets=self._peak_sets,
            peak_activation_bytes=self._peak_bytes,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if cuda else None,
            peak_recv_buffer_bytes=dict(self.comm.peak_recv_bytes) if self.comm is not None else {},
            reduce_exposed_ms=times[end] - times[compute_end],
            reduce_issued_ms={s: times[m] for s, m in self._reduce_marks.items()},
            reduce_done_ms={s: times[m] for s, m in self._reduce_done.items()},
        )

    def _range(self, what: object) -> contextlib.AbstractContextManager:
        """A torch.profiler range named as torch.distributed.pipelining names its own, `PP:0F3`."""
        return torch.profiler.record_function(f"PP:{what}") if self.profile_ranges else contextlib.nullcontext()

    def _poll_reductions(self) -> None:
        for s in self.reducer.poll():  # type: ignore[union-attr]
            self._reduction_done(s)

    def _reduction_done(self, stage: int) -> None:
        if stage not in self._reduce_done:
            self._reduce_done[stage] = self.clock.mark()

    def _issue(self, boundary: int) -> None:
        if self.comm is not None:
            self.comm.issue(boundary)
        if self._recording and boundary in self._reduces_at:
            for s in self._reduces_at[boundary]:
                self._reduce_marks[s] = self.clock.mark()
                with self._range(f"{s}REDUCE_GRAD"):
                    self.reducer.reduce(s)  # type: ignore[union-attr]

    def _timings(self, spans: list[list[int]], times: list[float]) -> tuple[list[ActionTiming], list[CommEvent]]:
        """Marks -> per-step timings (span, receive waits, compute per part) and comm events."""
        waits: dict[tuple[int, int], float] = defaultdict(float)  # (step index, part) -> ms blocked
        comm = []
        for direction, msg, index, part, m0, m1 in self._comm_marks:
            t0, t1 = times[m0], times[m1]
            if direction == "recv":
                waits[(index, part)] += t1 - t0
            peer = msg.src if direction == "recv" else msg.dst
            comm.append(CommEvent(direction, msg.kind, msg.stage, msg.microbatch, peer, index, t0, t1))
        timings = []
        for index, (text, marks) in enumerate(zip(self._step_texts, spans)):
            t = [times[i] for i in marks]
            part_wait = [waits[(index, p)] for p in range(len(t) - 1)]
            part_ms = tuple(t[p + 1] - t[p] - part_wait[p] for p in range(len(t) - 1))
            timings.append(ActionTiming(index, text, t[0], t[-1], sum(part_wait), part_ms))
        return timings, comm

    def evaluate(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[float]:
        """Forward only (validation): this rank's F actions in schedule order, no graph kept.

        The loss returned is the mean over every counted target of every microbatch (token ids
        of -1 are padding, not counted; mode=eval pads its last batch so), each microbatch's
        mean weighted by its count; with full microbatches, the mean of their means.

        Dropping the backward actions from a deadlock-free schedule keeps it deadlock-free:
        a forward only ever waits for forwards, in the same per-rank order as in training.
        """
        self._reset(microbatches)
        self._forward_only = True
        if self.comm is not None:
            self.comm.begin(self._eval_plan, self.recv_buffer)
        try:
            with torch.no_grad():
                for boundary, action in enumerate(self._eval_plan.parts):
                    self._issue(boundary)
                    self._forward(action, str(action))
                self._issue(len(self._eval_plan.parts))
            if self.comm is not None:
                self.comm.finish()
        finally:
            self._forward_only = False
        self._ctx.clear()
        return self._mean_loss()[0]

    def _reset(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        M = self.schedule.num_microbatches
        if len(microbatches) != M:
            raise ValueError(f"expected {M} microbatches (pipeline.microbatches), got {len(microbatches)}")
        self._batch = microbatches  # as given (evaluate() counts targets on the host)
        inputs, targets = self._reads
        self._inputs = {m: to_device(microbatches[m][0], self.device) for m in sorted(inputs)}
        self._targets = {m: to_device(microbatches[m][1], self.device) for m in sorted(targets)}
        # Per step: an FSDP2 stage's parameters are the unsharded tensors only after its first forward.
        self._params: dict[int, list[torch.nn.Parameter]] = {}
        self._ctx: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._wstore: dict[tuple[int, int], WeightGradWork] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._act_bytes: dict[tuple[int, int], int] = {}
        self._live_bytes = self._peak_bytes = self._peak_sets = 0
        # Summed on the device, reduced once per step: no host sync per microbatch.
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._losses = 0
        self._comm_marks: list[tuple[str, Message, int, int, int, int]] = []  # (direction, msg, step, part, mark, mark)
        self._reduce_marks: dict[int, int] = {}  # stage -> clock mark when its reduction was issued
        self._reduce_done: dict[int, int] = {}  # stage -> clock mark when it was seen done

    def _run(self, a: Action, step_text: str) -> None:
        if a.op is Op.F:
            self._forward(a, step_text)
        elif a.op is Op.W:
            backward_weight(self._wstore.pop((a.stage, a.microbatch)))
            self._free(a.stage, a.microbatch)
        else:
            self._backward(a, step_text)

    # ---- actions ----------------------------------------------------------------------
    def _forward(self, a: Action, step_text: str) -> None:
        pl, s, m = self.schedule.placement, a.stage, a.microbatch
        prev = pl.prev_stage(s)
        if prev is None:
            x = self._inputs[m]
        else:
            x = self._take("act", prev, m, a, step_text)
        if x.is_floating_point() and not self._forward_only:
            # The first stage also asks for its input grad (and drops it) so that B does B's
            # share of the work, as the schedule and the simulator assume.
            x = x.detach().requires_grad_(True)
        counter = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), self._autocast():
            out = self.stages[s](x)
            if pl.next_stage(s) is None:
                loss = self.stages[s].loss(out, self._targets[m])
                if self._forward_only:  # evaluate(): weighted by its targets, so the mean is per token
                    n = counted_targets(self._batch[m][1])
                    self._loss_sum += loss.detach().double() * n if n else 0.0
                    self._losses += n
                else:
                    self._loss_sum += loss.detach().double()
                    self._losses += 1
                out = loss / self.schedule.num_microbatches
        if pl.next_stage(s) is not None:
            out = self._to_boundary(out)
            self._give("act", s, m, out.detach(), a)
        if self._forward_only:
            return
        self._ctx[(s, m)] = (x, out)
        self._alloc(s, m, counter.bytes)

    def _autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _to_boundary(self, out: torch.Tensor) -> torch.Tensor:
        """A stage output as it crosses to the next stage: in compute_dtype when floating.

        The cast stays in the graph (kept in `_ctx` as the output B/BW start from): the
        gradient coming back is then in compute_dtype too, and the cast's backward turns it
        into the dtype the stage produced (fp32 where a residual stream is fp32).
        """
        if self.compute_dtype is None or not out.is_floating_point():
            return out
        return out.to(self.compute_dtype)

    def _backward(self, a: Action, step_text: str) -> None:
        pl, s, m = self.schedule.placement, a.stage, a.microbatch
        x, out = self._ctx.pop((s, m))
        nxt = pl.next_stage(s)
        grad = None if nxt is None else self._take("grad", nxt, m, a, step_text)
        assert grad is None or grad.dtype == out.dtype, f"{step_text}: gradient {grad.dtype} for output {out.dtype}"
        if a.op is Op.B:
            grads, work = backward_input([out], [grad], [x], self._weights(s))
            self._wstore[(s, m)] = work
        else:
            grads = backward_full([out], [grad], [x], self._weights(s))
            self._free(s, m)
        if pl.prev_stage(s) is not None:
            self._give("grad", s, m, grads[0], a)

    def _weights(self, s: int) -> list[torch.nn.Parameter]:
        if s not in self._params:
            self._params[s] = [p for p in self.stages[s].parameters() if p.requires_grad]
        return self._params[s]

    # ---- data movement: local hand-off or point-to-point ------------------------------
    def _give(self, kind: str, s: int, m: int, tensor: torch.Tensor, a: Action) -> None:
        msg = self._sends[a] if a in self._sends else sent_by(a, self.schedule, self.rank)
        if msg is None:
            self._local[(kind, s, m)] = tensor
        else:
            assert self.comm is not None
            self.comm.produced(msg, tensor)
            if self._recording:
                mark = self.clock.mark()
                self._comm_marks.append(("send", msg, self._index, self._part, mark, mark))

    def _take(self, kind: str, src_stage: int, m: int, a: Action, step_text: str) -> torch.Tensor:
        msg: Optional[Message] = self._needs[a] if a in self._needs else needed_by(a, self.schedule, self.rank)
        if msg is None:
            return self._local.pop((kind, src_stage, m))
        assert self.comm is not None
        what = f"{step_text} on {self.comm.short(self.rank)}"  # the global rank (self.rank: its pipeline index)
        if not self._recording:
            return self.comm.receive(msg, action=what)
        m0 = self.clock.mark()
        tensor = self.comm.receive(msg, action=what)
        self._comm_marks.append(("recv", msg, self._index, self._part, m0, self.clock.mark()))
        return tensor

    # ---- bookkeeping ------------------------------------------------------------------
    def _alloc(self, s: int, m: int, nbytes: int) -> None:
        self._act_bytes[(s, m)] = nbytes
        self._live_bytes += nbytes
        if len(self._act_bytes) > self._peak_sets:
            self._peak_sets = len(self._act_bytes)
        self._peak_bytes = max(self._peak_bytes, self._live_bytes)

    def _free(self, s: int, m: int) -> None:
        self._live_bytes -= self._act_bytes.pop((s, m))

    def _mean_loss(self, *, mark: bool = False) -> tuple[Optional[float], Optional[int]]:
        """(the step's mean loss, with `mark` the clock mark taken as the all-reduce ended: on GPU
        stream-ordered after it; None without a process group)."""
        if self.loss_group is None and not dist.is_initialized():
            return (float(self._loss_sum / self._losses) if self._losses else None), None
        dev = self._reduce_device()
        buf = torch.stack([self._loss_sum.to(dev), torch.tensor(float(self._losses), dtype=torch.float64, device=dev)])
        dist.all_reduce(buf, group=self.loss_group)
        sync = self.clock.mark() if mark else None
        total, count = buf.tolist()
        return (total / count if count else None), sync

    def _reduce_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")
