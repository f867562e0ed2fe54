"""What one executor step reports (StepResult), and how it counts the bytes autograd saves
for a forward (SavedBytes, a saved_tensors_hooks pair)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pipetrain.compat import view_base
from pipetrain.metrics.records import ActionTiming, CommEvent


@dataclass
class StepResult:
    """A measured step fills every field (runtime/recorder.py); an unmeasured one
    (`Executor.measure = False`) only `loss` and `peak_recv_buffer_bytes`."""

    loss: Optional[float]  # mean loss over the step's microbatches (None without a process group and no last stage)
    # one per step of the rank's list, with receive waits and the collectives inside (runtime/collectives.py)
    timings: list[ActionTiming] = field(default_factory=list)
    comm: list[CommEvent] = field(default_factory=list)  # every cross-rank send and receive of the step
    step_ms: float = 0.0
    # ms from the step's start to the end of its closing loss all-reduce, which every rank leaves
    # at one moment: puts the ranks' timings on one axis (None: no process group, one rank)
    sync_ms: Optional[float] = None
    peak_activation_sets: int = 0  # most (stage, microbatch) sets alive at once
    peak_activation_bytes: int = 0  # bytes autograd saved for them, at that peak
    peak_memory_bytes: Optional[int] = None  # torch.cuda.max_memory_allocated on GPU
    peak_reserved_bytes: Optional[int] = None  # torch.cuda.max_memory_reserved on GPU (+ cached, fragmented)
    peak_recv_buffer_bytes: dict[int, int] = field(default_factory=dict)  # stage -> most bytes of posted receives
    reduce_exposed_ms: float = 0.0  # end of the last action -> every gradient reduction done (data parallel)
    reduce_issued_ms: dict[int, float] = field(default_factory=dict)  # stage -> when its reduction started
    # stage -> when the executor saw its reduction done: between actions (polled), or in the final wait
    reduce_done_ms: dict[int, float] = field(default_factory=dict)


class SavedBytes:
    """Counts the bytes autograd saves during one forward (saved_tensors_hooks)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # A saved weight (a LayerNorm's, a Linear's transposed view of its own) is the parameter's
        # storage, held by the model whatever is in flight: counting it made every microbatch in
        # flight carry a copy of the stage's weights (GPT-2 tiny's tied 512 x 128 head: 2 KB per
        # token at 2 x 64 tokens). A weight cast under autocast is a new tensor and counts.
        # (Parameter's isinstance is a Python-level check: asked of a view's base only.)
        base = view_base(t)
        if isinstance(t, nn.Parameter) or (base is not None and isinstance(base, nn.Parameter)):
            return t.detach()
        storage = t.untyped_storage()
        key = id(t) if t.is_meta else storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        # A detached alias (same storage and version counter): returning t itself ties a node
        # that saves its own output (attention, layer norm, log-softmax) to itself through C++,
        # a cycle Python's GC cannot see; the split backward's retained graphs then leaked
        # ~11 MB per microbatch, and every new allocation page-faulted (zbv ran 1.4x slower).
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t
