"""The one interpreter of a rank's action list.

It knows nothing about schedule names. Where an input comes from, where an output
goes, which stage computes the loss, whether a neighbour is local or remote: all of it
comes from the schedule's placement. Per action:

  F(s, m)    input = the microbatch (first stage of its chain), the local output of prev(s),
             or the received activation; run the stage; its loss on the chain's last stage,
             else hand the output to next(s).
  B(s, m)    input gradient only (runtime/backward.py); keep what W needs; send it back.
  W(s, m)    weight gradients from what B kept.
  BW(s, m)   both at once.
  F&B        its forward, then its backward; under pipeline.fb_overlap (runtime/overlap.py) the
             stages run node by node (runtime/nodes.py) and the pair's nodes interleave, so one
             microbatch's expert-parallel all-to-alls run under the other's compute.

Under data parallel the schedule carries `{stage}REDUCE_GRAD` marks (schedules/reduce.py):
there the stage's gradient reduction is started (runtime/grad_reduce.py), and after the
last action the executor waits for all of them; that wait is the step's exposed reduce time.
Without, `grads_done` starts the sums of mirrored copies there (runtime/sync.py GradSync.early).

After the last action, the summed loss is all-reduced so every rank (rank 0 logs it) holds the
step's mean loss (over every pipeline's microbatches under data parallel); a loss's backward starts
from 1/M, so gradients are the mean (runtime/step_loss.py). Inputs and targets move to the device
once per step, pinned and non-blocking (runtime/batch.py). Mixed precision: runtime/precision.py.

What a step measures (timings, comm events, activation memory, when reductions started and
ended, the closing all-reduce's mark that puts every rank on one axis) is the recorder's
(runtime/recorder.py): the interpreter calls it at fixed points and knows nothing of clocks.
`measure=False` (the trainer's unlogged steps) swaps in a recorder that records nothing.

Everything per action that does not change from step to step (the message an action receives
and the one it sends, its name in error messages) is worked out once, in `_program`.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from pipetrain.runtime.backward import backward_full, backward_input, backward_weight
from pipetrain.runtime.batch import counted_targets, to_device
from pipetrain.runtime.clock import StepClock
from pipetrain.runtime.comm import P2P
from pipetrain.runtime.grad_reduce import GradReducer
from pipetrain.runtime.nodes import NodeBackward, NodeForward
from pipetrain.runtime.overlap import node_execution
from pipetrain.runtime.precision import Precision
from pipetrain.runtime.recorder import Recorder, StepRecorder
from pipetrain.runtime.stage_protocol import Stage
from pipetrain.runtime.step_loss import StepLoss
from pipetrain.runtime.step_result import StepResult
from pipetrain.schedules.ir import Action, Op, Schedule
from pipetrain.schedules.p2p import Message, build_plan, crossings, forward_plan

# One atomic action as the interpreter runs it: (action, the message it receives from another
# rank, the one it sends to another rank (None: local or none), its name in error messages).
Part = tuple[Action, Optional[Message], Optional[Message], str]


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
        fb_overlap: str = "off",
        a2a_timeout_s: Optional[float] = None,
        grads_done: Optional[Mapping[int, Callable[[], None]]] = None,
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
        self._step_loss = StepLoss(self.device, loss_group, schedule.num_microbatches)
        self.precision = Precision(self.device, compute_dtype)
        # The point-to-point plans (pure; validated before any process started): training, evaluate()'s
        self._plan = build_plan(schedule, rank, lookahead=lookahead)
        self._eval_plan = forward_plan(self._plan)
        sends = {a: out for a, _, out in crossings(schedule, rank)}
        on = f" on {comm.short(rank)}" if comm is not None else ""  # the global rank (rank: its pipeline index)
        waits = dict(zip(self._plan.parts, self._plan.waits))
        texts = [str(step) for step in schedule.steps[rank]]
        # Per step of the rank's list, its parts (two for an F&B pair), worked out once.
        self._program: list[tuple[Part, ...]] = [tuple((a, waits[a], sends[a], text + on) for a in step.parts())
                                                 for step, text in zip(schedule.steps[rank], texts)]
        self._eval_program: list[Part] = [(a, need, sends[a], f"{a}{on}")
                                          for a, need in zip(self._eval_plan.parts, self._eval_plan.waits)]
        fs = [a for a in schedule.actions(rank) if a.op is Op.F]  # whose input / target (chain ends) it reads
        self._reads = ({a.microbatch for a in fs if pl.prev_stage(a.stage) is None},
                       {a.microbatch for a in fs if pl.next_stage(a.stage) is None})
        # each held stage's neighbours in its chain (None: it starts / ends it), looked up per action
        self._prev = {s: pl.prev_stage(s) for s in want}
        self._next = {s: pl.next_stage(s) for s in want}
        self.reducer = reducer
        # boundary -> what starts there: the stages' dp reductions, and `grads_done` (sums across copies)
        self._hooks: dict[int, list[Callable[[], None]]] = defaultdict(list)
        for b, red in (schedule.reduces[rank] if schedule.reduces and reducer is not None else ()):
            self._hooks[b].append(functools.partial(self._reduce, red.stage))
        if reducer is not None and not self._hooks:
            raise ValueError("a gradient reducer needs a schedule with REDUCE_GRAD marks (schedules/reduce.py)")
        for b, done in (grads_done or {}).items():
            self._hooks[b].append(done)
        self._forward_only = False
        self._bare = False  # step(), evaluate(): nothing recorded and no autocast, so no context per action
        self.recorder = StepRecorder(self.device, texts, reducer)
        self._unmeasured = Recorder()
        self._rec: Recorder = self.recorder
        self.measure = True  # False: a step records nothing but its loss (the trainer's unlogged steps)
        if fb_overlap == "auto" and not any(len(parts) == 2 for parts in self._program):
            fb_overlap = "off"  # no F&B pair to overlap in (1F1B, ZB): whole stages, no node overhead
        self.nodes = node_execution(stages, fb_overlap, self.device, timeout_s=a2a_timeout_s)  # None: run whole
        # F&B steps that interleave: the backward's gradient must be at hand (local, or its receive
        # posted before the pair: p2p_lookahead >= 1) as its first node runs before the forward ends.
        self._paired = set() if self.nodes is None or not self.nodes.interleave else {
            i for i, parts in enumerate(self._program)
            if len(parts) == 2 and parts[0][0].op is Op.F and (parts[1][1] is None or lookahead >= 1)}

    @property
    def clock(self) -> StepClock:
        """The measured steps' clock (replaceable: a clock with another host timer measures alike)."""
        return self.recorder.clock

    @clock.setter
    def clock(self, clock: StepClock) -> None:
        self.recorder.clock = clock

    @property
    def profile_ranges(self) -> bool:
        """Every action a `PP:<action>` torch.profiler range (the trainer sets it for its captured steps)."""
        return self.recorder.profile_ranges

    @profile_ranges.setter
    def profile_ranges(self, on: bool) -> None:
        self.recorder.profile_ranges = self._unmeasured.profile_ranges = on

    def close(self) -> None:
        """Release what outlives a step: the point-to-point transport's threads (in-order mode)."""
        if self.comm is not None:
            self.comm.close()

    # ---- the interpreter ----------------------------------------------------------------
    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Run every action of this rank once; `microbatches[m]` is (input, target) of microbatch m."""
        rec = self._use(self.recorder if self.measure else self._unmeasured)
        self._reset(microbatches)
        if self.nodes is not None:
            self.nodes.log.begin_step()
        if self.comm is not None:
            self.comm.begin(self._plan, self.recv_buffer)
        if self.reducer is not None:
            self.reducer.begin()
            if self.nodes is not None:
                self.reducer.gather()
        rec.begin_step()
        boundary = 0  # index of the next atomic action: where the plan issues communication
        for index, parts in enumerate(self._program):
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
        loss = self._step_loss.mean(synced=rec.synced)
        return rec.result(loss, dict(self.comm.peak_recv_bytes) if self.comm is not None else {})

    def _use(self, rec: Recorder) -> Recorder:
        """The step's recorder; with nothing to record and no autocast, no context per action."""
        self._rec = rec
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

    def _reduce(self, s: int) -> None:
        self._rec.reduce_issued(s)
        with self._rec.range(f"{s}REDUCE_GRAD"):
            self.reducer.reduce(s)  # type: ignore[union-attr]

    def _forward(self, a: Action, need: Optional[Message], send: Optional[Message], where: str) -> None:
        x = self._input(a, need, where)
        if self.nodes is not None and not self._forward_only:
            run = self.nodes.forward(a.stage, a.microbatch, x, lambda: self._node_ctx(a.stage, a.microbatch))
            self.nodes.run(run.layers())
            self._forward_done(a, x, run, send)
            return
        if self._bare:  # nothing to record, no autocast: no context to enter
            out = self._stage_forward(a, x)
        else:
            with self._rec.saving(a.stage, a.microbatch), self.precision.autocast():
                out = self._stage_forward(a, x)
        self._forward_out(a, x, out, send)

    def _stage_forward(self, a: Action, x: torch.Tensor) -> torch.Tensor:
        out = self.stages[a.stage](x)
        return out if self._next[a.stage] is not None else self._loss(a.stage, a.microbatch, out)

    def _input(self, a: Action, need: Optional[Message], where: str) -> torch.Tensor:
        prev = self._prev[a.stage]
        x = self._inputs[a.microbatch] if prev is None else self._take("act", prev, a.microbatch, need, where)
        if x.is_floating_point() and not self._forward_only:
            # the first stage too (its input grad dropped): B does B's share, as schedule and simulator assume
            x = x.detach().requires_grad_(True)
        return x

    @contextlib.contextmanager
    def _node_ctx(self, s: int, m: int):
        with self._rec.saving(s, m), self.precision.autocast():
            yield

    def _forward_done(self, a: Action, x: torch.Tensor, run: NodeForward, send: Optional[Message]) -> None:
        """The last node ran: the loss on the chain's last stage, then as a whole forward ends."""
        out = run.output()
        if self._next[a.stage] is None:
            with self._node_ctx(a.stage, a.microbatch):
                out = self._loss(a.stage, a.microbatch, out)
        self._forward_out(a, x, out, send, run)

    def _forward_out(self, a: Action, x: torch.Tensor, out: torch.Tensor, send: Optional[Message],
                     run: Optional[NodeForward] = None) -> None:
        s, m = a.stage, a.microbatch
        if self._next[s] is not None:
            out = self.precision.to_boundary(out)
            self._give("act", s, m, out.detach(), send)
        if not self._forward_only:
            self._ctx[(s, m)] = (x, out, run)

    def _backward(self, a: Action, need: Optional[Message], send: Optional[Message], where: str) -> None:
        x, out, grad, bwd = self._backward_start(a, need, where)
        if bwd is not None:
            self.nodes.run(bwd.layers())  # type: ignore[union-attr]
            self._backward_done(a, bwd.input_grad(), bwd.works, send)
        elif a.op is Op.B:
            grads, work = backward_input([out], [grad], [x], self._weights(a.stage))
            self._backward_done(a, grads[0], [work], send)
        else:
            self._backward_done(a, backward_full([out], [grad], [x], self._weights(a.stage))[0], [], send)

    def _backward_start(self, a: Action, need: Optional[Message], where: str):
        x, out, run = self._ctx.pop((a.stage, a.microbatch))
        nxt = self._next[a.stage]
        grad = self._step_loss.seed(out) if nxt is None else self._take("grad", nxt, a.microbatch, need, where)
        assert grad is None or grad.dtype == out.dtype, f"{where}: gradient {grad.dtype} for output {out.dtype}"
        bwd = None if run is None else NodeBackward(run, out, grad, split=a.op is Op.B)
        return x, out, grad, bwd

    def _backward_done(self, a: Action, grad: Optional[torch.Tensor], works: list, send: Optional[Message]) -> None:
        if a.op is Op.B:
            self._wstore[(a.stage, a.microbatch)] = works  # what W needs (backward.WeightGradWork per node)
        else:
            self._rec.freed(a.stage, a.microbatch)
        if self._prev[a.stage] is not None:
            self._give("grad", a.stage, a.microbatch, grad, send)

    def _pair(self, parts: tuple[Part, ...], boundary: int) -> None:
        """An F&B step, its nodes interleaved (runtime/overlap.py); the plan's communication before the
        backward part is issued as soon as the forward's output exists."""
        (fa, fneed, fsend, fwhere), (ba, bneed, bsend, bwhere) = parts
        x = self._input(fa, fneed, fwhere)
        run = self.nodes.forward(fa.stage, fa.microbatch, x,  # type: ignore[union-attr]
                                 lambda: self._node_ctx(fa.stage, fa.microbatch))
        bwd = self._backward_start(ba, bneed, bwhere)[3]
        assert bwd is not None, "node mode runs every forward by nodes"

        def forward_done() -> None:
            self._forward_done(fa, x, run, fsend)
            self._issue(boundary + 1)

        self.nodes.pair(run, bwd, forward_done)  # type: ignore[union-attr]
        self._backward_done(ba, bwd.input_grad(), bwd.works, bsend)

    # ---- data movement: local hand-off or point-to-point ------------------------------
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

    # ---- around the interpreter ---------------------------------------------------------
    def evaluate(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[float]:
        """Forward only (validation): this rank's F actions in schedule order, no graph kept.

        The loss returned is the mean over every counted target of every microbatch (token ids
        of -1 are padding, not counted; mode=eval pads its last batch so), each microbatch's
        mean weighted by its count; with full microbatches, the mean of their means.

        Dropping the backward actions from a deadlock-free schedule keeps it deadlock-free:
        a forward only ever waits for forwards, in the same per-rank order as in training.
        """
        self._reset(microbatches)
        self._use(self._unmeasured)
        self._forward_only = True
        comm = self.comm
        if comm is not None:
            comm.begin(self._eval_plan, self.recv_buffer)
        try:
            with torch.no_grad():
                for boundary, (a, need, send, where) in enumerate(self._eval_program):
                    if comm is not None:
                        comm.issue(boundary)
                    self._forward(a, need, send, where)
                if comm is not None:
                    comm.issue(len(self._eval_program))
                    comm.finish()
        finally:
            self._forward_only = False
        self._ctx.clear()
        return self._step_loss.mean()

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
        # (stage, microbatch) -> its input, output and, in node mode, its node forward
        self._ctx: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Optional[NodeForward]]] = {}
        self._wstore: dict = {}  # (stage, microbatch) -> what its B kept for its W (backward.WeightGradWork per node)
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._step_loss.reset()

    def _loss(self, s: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of microbatch m, kept for the step's mean; B starts at StepLoss.seed."""
        loss = self.stages[s].loss(out, self._targets[m])
        # evaluate(): weighted by its targets, so the mean is per token
        self._step_loss.add(loss, counted_targets(self._batch[m][1]) if self._forward_only else None)
        return loss

    def _weights(self, s: int) -> list[torch.nn.Parameter]:
        if s not in self._params:
            self._params[s] = [p for p in self.stages[s].parameters() if p.requires_grad]
        return self._params[s]
