"""What the registry knows about one schedule family member: how to build it, its
constraints, and its published bubble. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pipetrain.schedules.ir import Schedule, Step
from pipetrain.schedules.placement import Placement


@dataclass(frozen=True)
class RankCosts:
    """Costs of one microbatch through one rank's share of the model (the F, B, W of the papers).

    `FB` is an overlapped F&B pair over that share: (F + B + W) * (1 - fb_overlap).
    """

    F: float
    B: float
    W: float
    FB: float

    @property
    def BW(self) -> float:
        return self.B + self.W


# (P, M, v) -> per-rank ordered steps
Generator = Callable[[int, int, int], Sequence[Sequence[Step]]]
# (P, M, v) -> None, raising ValueError that names the config knob to change
Checker = Callable[[int, int, int], None]
# (P, v, costs) -> idle time of every rank (ms), the published bubble
AnalyticBubble = Callable[[int, int, RankCosts], float]


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    placement_kind: str  # "loop" | "v" | "mirror"
    generate: Generator
    check: Checker
    description: str
    # Stages per rank when the family fixes it (1 for GPipe/1F1B/ZB-H*, 2 for V and mirror);
    # None when the user picks it with schedule.virtual_stages (interleaved, looped BFS).
    fixed_stages_per_rank: Optional[int] = 1
    analytic_bubble: Optional[AnalyticBubble] = None

    def stages_per_rank(self, virtual_stages: int) -> int:
        return self.fixed_stages_per_rank or virtual_stages

    def placement(self, num_ranks: int, virtual_stages: int = 1) -> Placement:
        return Placement(self.placement_kind, num_ranks, self.stages_per_rank(virtual_stages))

    def is_valid(self, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> bool:
        try:
            self.check(num_ranks, num_microbatches, self.stages_per_rank(virtual_stages))
        except ValueError:
            return False
        return True

    def build(self, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
        """Check constraints (clear ValueError), then generate the per-rank steps."""
        v = self.stages_per_rank(virtual_stages)
        self.check(num_ranks, num_microbatches, v)
        steps = self.generate(num_ranks, num_microbatches, v)
        return Schedule.build(self.name, self.placement(num_ranks, v), num_microbatches, steps)


def require(condition: bool, message: str) -> None:
    """Raise the user-facing ValueError when a schedule constraint does not hold."""
    if not condition:
        raise ValueError(message)


def check_basic(name: str, P: int, M: int) -> None:
    require(P >= 1, f"{name}: pipeline.degree must be >= 1 (got {P})")
    require(M >= 1, f"{name}: pipeline.microbatches must be >= 1 (got {M})")
