"""Placement: which rank holds which stage, and which way microbatches flow.

Stage ids are global integers. A *chain* is the ordered list of stage ids one
microbatch passes through (forward in chain order, backward in reverse). A
*chunk* is a piece of the partitioned model (a contiguous run of layers); a
stage holds exactly one chunk, and with DualPipe's mirror two stages hold the
same chunk (the model is stored twice).

Three kinds, for P ranks:

  loop    v stages per rank, stage s on rank s % P; one chain 0..vP-1.
          (v=1: GPipe/1F1B/ZB-H1/ZB-H2; v>1: interleaved, looped BFS.)
  v       2 stages per rank, rank r holds stages r and 2P-1-r; one chain
          0..2P-1 that goes down the ranks and back up (ZB-V, DualPipe-V).
  mirror  DualPipe: chain 0 is stages 0..P-1 on ranks 0..P-1; chain 1 is
          stages P..2P-1 on ranks P-1..0, so rank r holds stage r (chunk r) of
          one direction and stage 2P-1-r (chunk P-1-r) of the other.
          Microbatches 0..M/2-1 enter at rank 0, M/2..M-1 at rank P-1.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

PLACEMENT_KINDS = ("loop", "v", "mirror")


@dataclass(frozen=True)
class Placement:
    kind: str
    num_ranks: int
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(f"unknown placement {self.kind!r}: choose one of {', '.join(PLACEMENT_KINDS)}")
        if self.num_ranks < 1:
            raise ValueError(f"a placement needs at least 1 rank, got {self.num_ranks}")
        if self.stages_per_rank < 1:
            raise ValueError(f"stages per rank must be >= 1, got {self.stages_per_rank}")
        if self.kind in ("v", "mirror") and self.stages_per_rank != 2:
            raise ValueError(f"placement {self.kind!r} holds exactly 2 stages per rank, got {self.stages_per_rank}")

    @classmethod
    def loop(cls, num_ranks: int, stages_per_rank: int = 1) -> "Placement":
        return cls("loop", num_ranks, stages_per_rank)

    @classmethod
    def vshape(cls, num_ranks: int) -> "Placement":
        return cls("v", num_ranks, 2)

    @classmethod
    def mirror(cls, num_ranks: int) -> "Placement":
        return cls("mirror", num_ranks, 2)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    @property
    def num_chunks(self) -> int:
        """Distinct model pieces: the partition cuts the model into this many stages."""
        return self.num_ranks if self.kind == "mirror" else self.num_stages

    @property
    def param_copies(self) -> int:
        """How many times every parameter is stored across the pipeline."""
        return 2 if self.kind == "mirror" else 1

    def rank_of(self, stage: int) -> int:
        return self._stage_rank[stage]

    def chunk_of(self, stage: int) -> int:
        P = self.num_ranks
        if self.kind == "mirror" and stage >= P:
            return stage - P
        return stage

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stage ids held by a rank, in increasing order."""
        return self._rank_stages[rank]

    @property
    def chains(self) -> tuple[tuple[int, ...], ...]:
        S, P = self.num_stages, self.num_ranks
        if self.kind == "mirror":
            return (tuple(range(P)), tuple(range(P, 2 * P)))
        return (tuple(range(S)),)

    def chain_of(self, microbatch: int, num_microbatches: int) -> int:
        """Which chain (direction) a microbatch flows through."""
        if self.kind == "mirror":
            return 0 if microbatch < num_microbatches // 2 else 1
        return 0

    def prev_stage(self, stage: int) -> int | None:
        """The stage feeding this one in the forward pass (None for a chain's first stage)."""
        return self._neighbours[stage][0]

    def next_stage(self, stage: int) -> int | None:
        """The stage this one feeds in the forward pass (None for a chain's last stage, the loss)."""
        return self._neighbours[stage][1]

    def chain_of_stage(self, stage: int) -> int:
        return self._stage_chain[stage]

    def describe(self) -> str:
        P = self.num_ranks
        parts = [f"rank {r}: stages {list(self.stages_of(r))}" for r in range(P)]
        return f"{self.kind} placement, {self.num_stages} stages on {P} ranks ({'; '.join(parts)})"

    # ---- derived tables -------------------------------------------------
    @cached_property
    def _stage_rank(self) -> tuple[int, ...]:
        P, S = self.num_ranks, self.num_stages
        if self.kind == "loop":
            return tuple(s % P for s in range(S))
        # v and mirror share the rank map: stage s < P on rank s, stage s >= P on rank 2P-1-s.
        return tuple(s if s < P else 2 * P - 1 - s for s in range(S))

    @cached_property
    def _rank_stages(self) -> tuple[tuple[int, ...], ...]:
        table: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, r in enumerate(self._stage_rank):
            table[r].append(s)
        return tuple(tuple(t) for t in table)

    @cached_property
    def _stage_chain(self) -> tuple[int, ...]:
        out = [0] * self.num_stages
        for c, chain in enumerate(self.chains):
            for s in chain:
                out[s] = c
        return tuple(out)

    @cached_property
    def _neighbours(self) -> tuple[tuple[int | None, int | None], ...]:
        out: list[tuple[int | None, int | None]] = [(None, None)] * self.num_stages
        for chain in self.chains:
            for i, s in enumerate(chain):
                prev = chain[i - 1] if i > 0 else None
                nxt = chain[i + 1] if i + 1 < len(chain) else None
                out[s] = (prev, nxt)
        return tuple(out)
