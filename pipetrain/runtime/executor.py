"""The one interpreter of a rank's action list.

It knows nothing about schedule names. Where an input comes from, where an output goes, which
stage computes the loss, whether a neighbour is local or remote: all of it comes from the
schedule's placement, worked out once per rank (schedules/program.py). Per action:

  F(s, m)    input = the microbatch (first stage of a chain), the local output of prev(s), or the
             received activation; run the stage; the loss on a chain's last stage, else to next(s).
  B(s, m)    input gradient only (runtime/backward.py); keep what W needs; send it back.
  W(s, m)    weight gradients from what B kept.         BW(s, m)   both at once.
  F&B        its forward, then its backward; under pipeline.fb_overlap interleaved node by node.

How a pass of a stage runs (whole, or node by node) is runtime/stage_passes.py's: the interpreter
calls `passes.forward`, `passes.backward` and, for an interleaved F&B pair, `passes.pair`.

Under data parallel the schedule carries `{stage}REDUCE_GRAD` marks (schedules/reduce.py): there
the stage's gradient reduction starts (runtime/grad_reduce.py); after the last action the executor
waits for all of them (the step's exposed reduce time). Without, `grads_done` starts the sums of
mirrored copies there (runtime/sync.py GradSync.early). The summed loss is then all-reduced so every
rank holds the step's mean loss (every pipeline's microbatches); a loss's backward starts from 1/M
(runtime/step_loss.py). Inputs and targets, and under document masks every microbatch's documents
(runtime/documents.py: each stage pass of the microbatch gets them), move to the device once per step
(runtime/batch.py StepBatch); mixed precision: runtime/precision.py. What a step measures (timings, comm
events, activation memory, reductions, the closing all-reduce's mark that puts every rank on one axis)
is the recorder's (runtime/recorder.py); `measure=False` (unlogged steps) swaps in one that records nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from pipetrain.runtime.backward import backward_weight
from pipetrain.runtime.batch import Batch, Docs, StepBatch, counted_targets
from pipetrain.runtime.comm import P2P
from pipetrain.runtime.grad_reduce import GradReducer
from pipetrain.runtime.overlap import stage_passes
from pipetrain.runtime.precision import Precision
from pipetrain.runtime.recorder import Recorder, StepRecorder
from pipetrain.runtime.stage_passes import WholeStages
from pipetrain.runtime.stage_protocol import Stage
from pipetrain.runtime.step_loss import GlobalTokens, StepLoss
from pipetrain.runtime.step_result import StepResult
from pipetrain.schedules.ir import Action, Op, Schedule
from pipetrain.schedules.p2p import Message
from pipetrain.schedules.program import Part, rank_program


class Executor:
    """Runs one rank's part of a schedule on its stage modules."""

    def __init__(self, schedule: Schedule, rank: int, stages: Mapping[int, Stage], *, comm: Optional[P2P],
                 recv_buffer: Optional[Callable[[Message], torch.Tensor]] = None, device: torch.device | str = "cpu",
                 loss_group: Optional[dist.ProcessGroup] = None, lookahead: int = 1,
                 reducer: Optional[GradReducer] = None, compute_dtype: Optional[torch.dtype] = None,
                 fb_overlap: str = "off", a2a_timeout_s: Optional[float] = None,
                 grads_done: Optional[Mapping[int, Callable[[], None]]] = None, loss_parts: int = 0) -> None:
        """`fb_overlap`: pipeline.fb_overlap (runtime/overlap.py stage_passes); `grads_done`: boundary -> what starts
        there besides the plan's communication (runtime/sync.py GradSync.early); `loss_parts`: runtime/step_loss.py."""
        want = set(schedule.placement.stages_of(rank))
        if set(stages) != want:
            raise ValueError(f"rank {rank} must hold stages {sorted(want)}, got {sorted(stages)}")
        if comm is None and schedule.num_ranks > 1:
            raise ValueError("a pipeline of several ranks needs a P2P transport")
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.comm, self.recv_buffer, self.device = comm, recv_buffer, torch.device(device)
        self.step_loss = StepLoss(self.device, loss_group, schedule.num_microbatches, parts=loss_parts)
        self.precision = Precision(self.device, compute_dtype)
        on = f" on {comm.short(rank)}" if comm is not None else ""  # the global rank (rank: its pipeline index)
        self.program = prog = rank_program(schedule, rank, lookahead=lookahead, where=on)
        self.reducer = reducer
        # boundary -> what starts there: the stages' dp reductions, and `grads_done` (sums across copies)
        self._hooks: dict[int, list[Callable[[], None]]] = defaultdict(list)
        for b, red in (schedule.reduces[rank] if schedule.reduces and reducer is not None else ()):
            self._hooks[b].append(functools.partial(self._reduce, red.stage))
        if reducer is not None and not self._hooks:
            raise ValueError("a gradient reducer needs a schedule with REDUCE_GRAD marks (schedules/reduce.py)")
        for b, done in (grads_done or {}).items():
            self._hooks[b].append(done)
        # evaluate(); a step (or evaluate()) with nothing recorded and no autocast: no context per action
        self._forward_only = self._bare = False
        self.recorder = StepRecorder(self.device, list(prog.texts), reducer)
        self._rec: Recorder = self.recorder
        self._unmeasured = Recorder()
        self.measure = True  # False: a step records nothing but its loss (the trainer's unlogged steps)
        self.profile_ranges = False  # every action a `PP:<action>` torch.profiler range (captured steps)
        self.batch = StepBatch(self.device, loss_inputs=any(s.is_last and s.loss_reads_inputs for s in stages.values()))
        self.passes = stage_passes(stages, fb_overlap, self.device, timeout_s=a2a_timeout_s,
                                   pairs=any(len(parts) == 2 for parts in prog.steps))
        # evaluate()'s forwards: whole stages, node mode or not
        self._whole = self.passes if isinstance(self.passes, WholeStages) else WholeStages(stages)
        # F&B steps that interleave: the backward's gradient must be at hand (local, or its receive
        # posted before the pair: p2p_lookahead >= 1) as its first node runs before the forward ends.
        self._paired = {i for i, parts in enumerate(prog.steps) if self.passes.interleave and len(parts) == 2
                        and parts[0][0].op is Op.F and (parts[1][1] is None or lookahead >= 1)}

    def close(self) -> None:
        """Release what outlives a step: the point-to-point transport's threads (in-order mode)."""
        if self.comm is not None:
            self.comm.close()

    def step(self, microbatches: Sequence[Batch], tokens: Optional[GlobalTokens] = None, docs: Docs = None
             ) -> StepResult:
        """Run every action of this rank once on `microbatches[m]` (tokens: runtime/step_loss.py; docs: batch.py)."""
        rec = self._use(self.recorder if self.measure else self._unmeasured)
        self._reset(microbatches, tokens, docs)
        if self.comm is not None:
            self.comm.begin(self.program.plan, self.recv_buffer)
        if self.reducer is not None:
            self.reducer.begin()
        self.passes.begin_step(self.reducer, self.batch.docs)
        rec.begin_step()
        boundary = 0  # index of the next atomic action: where the plan issues communication
        for index, parts in enumerate(self.program.steps):
            rec.begin(index)
            if index in self._paired:
                self._issue(boundary)
                with rec.range(parts[0][3]):
                    self._pair(parts, boundary)
                rec.part_done()  # the pair is one span: its forward and backward run interleaved
                rec.part_done()
                boundary += 2
                continue
            for a, need, send, where in parts:
                self._issue(boundary)
                if self._bare:
                    self._run(a, need, send, where)
                else:
                    with rec.range(a):
                        self._run(a, need, send, where)
                rec.part_done()
                boundary += 1
        self._issue(boundary)
        if self.comm is not None:
            self.comm.finish()
        rec.end_compute()
        if self.reducer is not None:
            self.reducer.finish(rec.reduce_done)
        rec.end_step()
        assert not self._ctx and not self._wstore, "validated schedule left work behind"
        loss = self.step_loss.mean(synced=rec.synced)
        return rec.result(loss, dict(self.comm.peak_recv_bytes) if self.comm is not None else {})

    def _use(self, rec: Recorder) -> Recorder:
        """The step's recorder; with nothing to record and no autocast, no context per action."""
        self._rec, rec.profile_ranges = rec, self.profile_ranges
        self._bare = rec is self._unmeasured and not rec.profile_ranges and not self.precision.mixed
        return rec

    def _run(self, a: Action, need: Optional[Message], send: Optional[Message], where: str) -> None:
        if a.op is Op.F:
            self._forward(a, need, send, where)
        elif a.op is Op.W:
            for work in self._wstore.pop((a.stage, a.microbatch)):
                backward_weight(work)
            self._rec.freed(a.stage, a.microbatch)
        else:
            self._backward(a, need, send, where)

    def _issue(self, boundary: int) -> None:
        """Before part `boundary` (and after the last): the plan's sends and receives, the reductions."""
        if self.comm is not None:
            self.comm.issue(boundary)
        for hook in self._hooks.get(boundary, ()):
            hook()

    def _reduce(self, s: int) -> None:  # a REDUCE_GRAD mark
        self._rec.reduce_issued(s)
        with self._rec.range(f"{s}REDUCE_GRAD"):
            self.reducer.reduce(s)  # type: ignore[union-attr]

    def _forward(self, a: Action, need: Optional[Message], send: Optional[Message], where: str) -> None:
        x = self._input(a, need, where)
        passes = self._whole if self._forward_only else self.passes
        out, saved = passes.forward(a.stage, a.microbatch, x, self._head, None if self._bare else self._wrap)
        self._forward_out(a, x, out, send, saved)

    def _head(self, s: int, m: int, out: torch.Tensor) -> torch.Tensor:  # the loss on a chain's last stage
        return out if self.program.next[s] is not None else self._loss(s, m, out)

    @contextlib.contextmanager
    def _wrap(self, s: int, m: int) -> Iterator[None]:  # a pass's compute: the recorder's saved-bytes hooks, autocast
        with self._rec.saving(s, m), self.precision.autocast():
            yield

    def _input(self, a: Action, need: Optional[Message], where: str) -> torch.Tensor:
        prev = self.program.prev[a.stage]
        x = self.batch.inputs[a.microbatch] if prev is None else self._take("act", prev, a.microbatch, need, where)
        if x.is_floating_point() and not self._forward_only:
            # the first stage too (its input grad dropped): B does B's share, as schedule and simulator assume
            x = x.detach().requires_grad_(True)
        return x

    def _forward_out(self, a: Action, x: torch.Tensor, out: torch.Tensor, send: Optional[Message], saved: Any) -> None:
        s, m = a.stage, a.microbatch
        if self.program.next[s] is not None:
            out = self.precision.to_boundary(out)
            self._give("act", s, m, out.detach(), send)
        if not self._forward_only:
            self._ctx[(s, m)] = (x, out, saved)

    def _backward(self, a: Action, need: Optional[Message], send: Optional[Message], where: str) -> None:
        gx, works = self.passes.backward(a.stage, a.microbatch, *self._backward_start(a, need, where),
                                         split=a.op is Op.B)
        self._backward_done(a, gx, works, send)

    def _backward_start(self, a: Action, need: Optional[Message], where: str) -> tuple:
        x, out, saved = self._ctx.pop((a.stage, m := a.microbatch))
        nxt = self.program.next[a.stage]
        grad = self.step_loss.seed(out, m) if nxt is None else self._take("grad", nxt, m, need, where)
        assert grad is None or grad.dtype == out.dtype, f"{where}: gradient {grad.dtype} for output {out.dtype}"
        return x, out, grad, saved

    def _backward_done(self, a: Action, grad: Optional[torch.Tensor], works: list, send: Optional[Message]) -> None:
        if a.op is Op.B:
            self._wstore[(a.stage, a.microbatch)] = works  # what W needs (backward.WeightGradWork per node)
        else:
            self._rec.freed(a.stage, a.microbatch)
        if self.program.prev[a.stage] is not None:
            self._give("grad", a.stage, a.microbatch, grad, send)

    def _pair(self, parts: tuple[Part, ...], boundary: int) -> None:
        """An F&B step interleaved (runtime/overlap.py); the backward's P2P issued once the forward's output exists."""
        (fa, fneed, fsend, fwhere), (ba, bneed, bsend, bwhere) = parts
        x = self._input(fa, fneed, fwhere)
        _, out, grad, saved = self._backward_start(ba, bneed, bwhere)

        def forward_done(f_out: torch.Tensor, f_saved: Any) -> None:
            self._forward_out(fa, x, f_out, fsend, f_saved)
            self._issue(boundary + 1)

        gx, works = self.passes.pair((fa.stage, fa.microbatch, x), (out, grad, saved),  # type: ignore[attr-defined]
                                     split=ba.op is Op.B, head=self._head, wrap=self._wrap, forward_done=forward_done)
        self._backward_done(ba, gx, works, bsend)

    def _give(self, kind: str, s: int, m: int, tensor: torch.Tensor, send: Optional[Message]) -> None:
        if send is None:
            self._local[(kind, s, m)] = tensor
        else:
            self.comm.produced(send, tensor)  # type: ignore[union-attr]
            self._rec.sent(send)

    def _take(self, kind: str, src_stage: int, m: int, need: Optional[Message], where: str) -> torch.Tensor:
        if need is None:
            return self._local.pop((kind, src_stage, m))
        since = self._rec.mark()
        tensor = self.comm.receive(need, action=where)  # type: ignore[union-attr]
        self._rec.received(need, since)
        return tensor

    def evaluate(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], docs: Docs = None) -> Optional[float]:
        """Forward only (validation): this rank's F actions in schedule order, whole stages, no graph kept;
        still deadlock-free (a forward only waits for forwards, in training's per-rank order). The loss is
        the mean over every counted target of every microbatch (ids of -1 are padding: mode=eval pads its
        last batch so), each microbatch's mean weighted by its count."""
        self._reset(microbatches, docs=docs)
        self._use(self._unmeasured)
        self._forward_only = True
        comm = self.comm
        if comm is not None:
            comm.begin(self.program.eval_plan, self.recv_buffer)
        try:
            with torch.no_grad():
                for boundary, (a, need, send, where) in enumerate(self.program.eval_steps):
                    if comm is not None:
                        comm.issue(boundary)
                    self._forward(a, need, send, where)
                if comm is not None:
                    comm.issue(len(self.program.eval_steps))
                    comm.finish()
        finally:
            self._forward_only = False
        self._ctx.clear()
        return self.step_loss.mean()

    def _reset(self, microbatches: Sequence[Batch], tokens: Optional[GlobalTokens] = None, docs: Docs = None
               ) -> None:
        M = self.schedule.num_microbatches
        if len(microbatches) != M:
            raise ValueError(f"expected {M} microbatches (pipeline.microbatches), got {len(microbatches)}")
        self.batch.load(microbatches, self.program.inputs, self.program.targets, docs)
        self._whole.begin_step(None, self.batch.docs)
        # (stage, microbatch) -> its input, output and what its backward needs (stage_passes.py)
        self._ctx: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Any]] = {}
        self._wstore: dict = {}  # (stage, microbatch) -> what its B kept for its W (backward.WeightGradWork per node)
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.step_loss.reset(tokens, [y for _, y in microbatches])

    def _loss(self, s: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of microbatch m, kept for the step's mean; B starts at StepLoss.seed."""
        loss = self.stages[s].loss(out, self.batch.targets[m], self.batch.loss_input.get(m))
        w = counted_targets(self.batch.given[m][1]) if self._forward_only else self.step_loss.count(m)  # per token
        self.step_loss.add(loss, w)
        return loss
