"""One description of the parallel layout: world = pp x dp_replicate x dp_shard x cp x tp, pp outermost.

A rank's coordinates are those of the DeviceMesh `("pp", "dp_replicate", "dp_shard", "cp", "tp")`
built from it (mesh.py, torchtitan's order): global rank = (((pp * dp_replicate + r) * dp_shard + s)
* cp + c) * tp + t. Ranks that share (r, s, c, t) form one pipeline (they exchange activations,
tp index to the same tp index); ranks that share (pp, t) hold the same stages and the same
tensor-parallel shard and reduce their gradients together: the data-parallel ones (r, s) take
different rows of the global batch, the context-parallel ones (c) different positions of the same
rows (parallel/cp.py); ranks that share (pp, r, s, c) form one tensor-parallel group (one stage's
layers split across them, collectives in every layer). tp innermost keeps a TP group, which talks
the most often, on neighbouring ranks (one node, as Megatron-LM and torchtitan place it), cp next
(its K/V traffic is in every attention); pp outermost puts the pipeline across nodes.

Expert parallel borrows its ranks from dp_shard (torchtitan's "dp2ep"; the world is unchanged):
dp_shard's index s splits as s = e_dp * ep + e, and the `ep` ranks of one block of consecutive
dp_shard indices (same pp, r, t, e_dp) split each MoE layer's experts between them, exchanging
tokens with all-to-all; the ranks holding the same experts (same pp, t, e; every r and e_dp) are
the expert-data-parallel group their expert gradients are reduced over. Consecutive ranks keep an
EP group inside one node while ep x tp <= the GPUs per node.

Pure Python: `mode=simulate` prints the rank table without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, within dp_shard
    cp: int = 1  # context parallel: a sequence's positions split across this many ranks

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout degree {name} must be >= 1 (got {getattr(self, name)})")
        if self.dp_shard % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard} (expert parallel "
                             f"borrows dp_shard's ranks): set parallel.dp_shard to a multiple of {self.ep}")
        for knob, other in (("tp", self.tp), ("cp", self.cp)):
            if self.ep > 1 and other > 1:
                raise ValueError(f"parallel.ep={self.ep} with parallel.{knob}={other} is not supported yet: "
                                 f"set one of them to 1")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many slices of the global batch (each taken by cp x tp pipelines)."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        rest, t = divmod(rank, self.tp)
        rest, c = divmod(rest, self.cp)
        rest, s = divmod(rest, self.dp_shard)
        p, r = divmod(rest, self.dp_replicate)
        return Coords(p, r, s, c, t)

    def rank_name(self, rank: int) -> str:
        """A global rank and, where the world is more than one pipeline, its place in the layout:
        'rank 3 (pp 1, dp_replicate 1)' (pp and each degree above 1). Under data parallel a bare number
        reads as a pipeline index, and the user kills, reads the log of, and restarts global ranks.
        The one way ranks are named: launch/errors.py rank_text, runtime/comm.py (through RankNames)."""
        if self.world == self.pp or not 0 <= rank < self.world:
            return f"rank {rank}"
        c = self.coords(rank)
        dims = [f"{name} {getattr(c, name)}" for name in DIMS if name == "pp" or getattr(self, name) > 1]
        return f"rank {rank} ({', '.join(dims)})"

    def rank_of(self, pp: int, dp_replicate: int = 0, dp_shard: int = 0, cp: int = 0, tp: int = 0) -> int:
        return (((pp * self.dp_replicate + dp_replicate) * self.dp_shard + dp_shard) * self.cp + cp) * self.tp + tp

    def _at(self, c: Coords, **change: int) -> int:
        return self.rank_of(**{**vars(c), **change})

    def dp_index(self, rank: int) -> int:
        """Which 1/dp slice of the global batch this rank's pipeline takes (replica-major)."""
        c = self.coords(rank)
        return c.dp_replicate * self.dp_shard + c.dp_shard

    def pp_rank(self, rank: int) -> int:
        return self.coords(rank).pp

    def tp_index(self, rank: int) -> int:
        return self.coords(rank).tp

    def cp_index(self, rank: int) -> int:
        return self.coords(rank).cp

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of this rank's pipeline (same dp, cp and tp indices), by pipeline rank."""
        c = self.coords(rank)
        return [self._at(c, pp=p) for p in range(self.pp)]

    def pipelines(self) -> list[list[int]]:
        """Every pipeline's global ranks (by pipeline rank), by dp index, then cp index, then tp index."""
        return [self.pipeline_ranks(self.rank_of(0, d // self.dp_shard, d % self.dp_shard, c, t))
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def dp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same stages and tp shard as `rank`, by dp index then cp index: the
        ranks its gradients are averaged over (data parallel, and context parallel's other positions)."""
        c = self.coords(rank)
        return [self._at(c, dp_replicate=d // self.dp_shard, dp_shard=d % self.dp_shard, cp=k)
                for d in range(self.dp) for k in range(self.cp)]

    def tp_ranks(self, rank: int) -> list[int]:
        """Global ranks splitting `rank`'s stages between them (its tensor-parallel group), by tp index."""
        c = self.coords(rank)
        return [self._at(c, tp=t) for t in range(self.tp)]

    def cp_ranks(self, rank: int) -> list[int]:
        """Global ranks splitting the positions of `rank`'s sequences (its context-parallel group), by cp index."""
        c = self.coords(rank)
        return [self._at(c, cp=k) for k in range(self.cp)]

    def ep_index(self, rank: int) -> int:
        """Which of its EP group's expert blocks `rank` holds."""
        return self.coords(rank).dp_shard % self.ep

    def ep_ranks(self, rank: int) -> list[int]:
        """Global ranks exchanging tokens with `rank` in its MoE layers (its expert-parallel group), by ep index."""
        c = self.coords(rank)
        first = c.dp_shard - c.dp_shard % self.ep
        return [self._at(c, dp_shard=first + e) for e in range(self.ep)]

    def edp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same experts as `rank` (its expert-data-parallel group), by dp index."""
        c = self.coords(rank)
        return [self._at(c, dp_replicate=r, dp_shard=s) for r in range(self.dp_replicate)
                for s in range(c.dp_shard % self.ep, self.dp_shard, self.ep)]

    def describe(self) -> str:
        parts = [f"pp={self.pp}"]
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"dp_shard={self.dp_shard}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        ep = f" (ep={self.ep} within dp_shard)" if self.ep > 1 else ""
        return " x ".join(parts) + f" = {self.world} ranks{ep}"

    @property
    def dp_mode(self) -> str:
        """none | replicate | shard | hsdp: how the gradients of one stage are reduced (context parallel
        shards the parameters over its ranks too, as torchtitan's fsdp = dp_shard x cp)."""
        if self.dp_shard * self.cp > 1:
            return "hsdp" if self.dp_replicate > 1 else "shard"
        return "replicate" if self.dp_replicate > 1 else "none"


def rank_rows(layout: Layout, stages_of: Sequence[Sequence[int]]) -> list[tuple[int, Coords, tuple[int, ...]]]:
    """(global rank, coordinates, stages it holds) for every rank; `stages_of[p]`: the
    placement's stages of pipeline rank p."""
    return [(r, layout.coords(r), tuple(stages_of[layout.coords(r).pp])) for r in range(layout.world)]
