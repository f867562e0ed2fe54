"""Schema of `profile.*`: a torch.profiler capture of chosen training steps. Pure: no torch.

    pipetrain profile.enabled=true profile.start_step=3 profile.steps=2

Each rank writes `profile/rank<r>.json` into the run directory (Chrome trace format: open it
in https://ui.perfetto.dev next to trace.json), holding the operators (and on CUDA the kernels)
of those steps with every pipeline action as a `PP:<action>` range (torch.distributed.pipelining
names its ranges the same way).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProfileConfig:
    enabled: bool = False  # capture a torch.profiler trace of profile.steps steps on every rank
    start_step: int = 2  # the first step captured, counted from 1 (step 1 pays for warm-up)
    steps: int = 1  # how many consecutive steps to capture
    record_shapes: bool = False  # input shapes of every operator (bigger trace)
    with_stack: bool = False  # Python call stacks of every operator (much bigger trace, slower)
    profile_memory: bool = False  # tensor allocations and frees in the trace (torch.profiler's memory view)
    # CUDA only: also record the allocator's history over those steps and dump a snapshot per rank,
    # profile/rank<r>_memory.pickle (drag it into https://pytorch.org/memory_viz).
    memory_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.start_step < 1:
            raise ValueError(f"profile.start_step must be a step number >= 1 (got {self.start_step})")
        if self.steps < 1:
            raise ValueError(f"profile.steps must be >= 1 (got {self.steps})")

    def check(self, *, max_steps: int) -> None:
        """Rules that need the rest of the config (called by Config.__post_init__)."""
        last = self.start_step + self.steps - 1
        if self.enabled and last > max_steps:
            raise ValueError(f"profile.start_step={self.start_step} with profile.steps={self.steps} "
                             f"ends at step {last}, past trainer.max_steps={max_steps}: "
                             "lower them or raise trainer.max_steps")

    def captures(self, step: int) -> bool:
        """Whether step `step` (counted from 1) is profiled."""
        return self.enabled and self.start_step <= step < self.start_step + self.steps
