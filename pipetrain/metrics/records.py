"""What one rank measured in one step, as plain picklable values (no torch).

The executor fills `ActionTiming` (with the collectives inside each action: `CollectiveEvent`)
and `CommEvent` (runtime/executor.py, runtime/recorder.py); the trainer wraps
them with the rank's memory into a `RankSample`, and at a logged step every rank's sample
travels to rank 0 in one `gather_object` (train/monitor.py), where metrics/measure.py turns
them into measured bubbles, the simulator's prediction and a timeline.

Times are milliseconds from the start of the rank's step (its own clock: perf_counter on
CPU, CUDA events on GPU); `RankSample.sync_ms`, when the step's closing loss all-reduce ended
on that clock, puts the ranks on one time axis: every rank leaves that collective at the same
moment, whatever its host's clock says (hosts' clocks disagree by milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective inside an action (runtime/collectives.py): an expert-parallel all-to-all, context
    parallel's K/V traffic, or (group "node") a node of a node-by-node stage, which has no bytes or wait."""

    group: str  # "ep", "cp" or "node"
    label: str  # "a2a:dispatch", "a2a:combine B" (its backward), "a2a:dispatch L3 mb5 F" (node mode), "cp:ring"
    nbytes: int  # ep: the all-to-all's output (own rows included); cp: what arrived from the other ranks
    start_ms: float  # issued
    wait_from_ms: float  # this rank began to wait for it (= start_ms: a blocking collective; = end_ms: a node)
    end_ms: float  # its wait returned (gloo says no earlier: an upper bound of the transfer's end)

    @property
    def total_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def exposed_ms(self) -> float:
        """Time this rank sat blocked waiting for it (what compute did not hide)."""
        return self.end_ms - self.wait_from_ms


@dataclass(frozen=True)
class ActionTiming:
    index: int  # position in the rank's step list
    step: str  # text form, e.g. "0F3" or "0F6&7BW2"
    start_ms: float  # from the start of the step
    end_ms: float
    wait_ms: float = 0.0  # of [start_ms, end_ms], time blocked in point-to-point receives
    part_ms: tuple[float, ...] = ()  # compute time of each part (an F&B pair: forward's, backward's)
    collectives: tuple[CollectiveEvent, ...] = ()  # all-to-alls and cp traffic inside it, in issue order

    @property
    def compute_ms(self) -> float:
        """Time the rank was busy with this action: its span less the receive waits."""
        return self.end_ms - self.start_ms - self.wait_ms


@dataclass(frozen=True)
class CommEvent:
    """One point-to-point transfer as one side saw it."""

    direction: str  # "send" or "recv"
    kind: str  # "act" (F output of `stage`) or "grad" (gradient w.r.t. the input of `stage`)
    stage: int
    microbatch: int
    peer: int  # the other rank
    action: int  # index of the action that sent or received it
    start_ms: float  # send: when it was posted; recv: when the action began to wait for it
    end_ms: float  # send: = start_ms (asynchronous); recv: when the tensor was there


@dataclass
class RankSample:
    """One rank's measurements of one optimizer step."""

    rank: int
    step_ms: float
    timings: list[ActionTiming]
    comm: list[CommEvent] = field(default_factory=list)
    peak_activation_sets: int = 0
    peak_activation_bytes: int = 0  # saved-tensor bytes alive at the peak (autograd hooks)
    cuda_peak_bytes: Optional[int] = None  # the CUDA allocator's peak over the step, on GPU
    # its peak of reserved memory (allocated + cached blocks, fragmentation included), on GPU
    cuda_reserved_bytes: Optional[int] = None
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    reduce_exposed_ms: float = 0.0  # data parallel: waiting for the gradient reductions after the last action
    reduce_issued_ms: dict[int, float] = field(default_factory=dict)  # stage -> when its reduction was issued
    # stage -> when the executor saw it done: an upper bound of the reduction's end (runtime/executor.py)
    reduce_done_ms: dict[int, float] = field(default_factory=dict)
    sync_ms: Optional[float] = None  # the end of the step's loss all-reduce (None: one process, no collective)
    moe: dict[str, float] = field(default_factory=dict)  # MoE blocks of this rank (models/moe_block.py: moe_step_stats)
    cp: dict[str, float] = field(default_factory=dict)  # context parallel traffic (parallel/cp.py: CPStats.take)

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what the rank holds besides activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_memory_bytes(self) -> int:
        """The allocator's peak on GPU; on CPU activations at their peak plus the static bytes."""
        if self.cuda_peak_bytes is not None:
            return self.cuda_peak_bytes
        return self.peak_activation_bytes + self.static_bytes
