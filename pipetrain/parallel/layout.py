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

Experts fold over the same ranks with their own degrees (Megatron-Core's "MoE parallel folding":
attention on tp x cp x dp, experts on etp x ep x edp; torchtitan's ep borrowing dp_shard x cp and tp).
Inside one (pp, dp_replicate) block the dense index i = (s * cp + c) * tp + t is read again, row-major,
as the expert mesh `("pp", "dp_replicate", "edp", "ep", "etp")`: i = (d * ep + e) * etp + u. With
etp = tp (each expert column- then row-split over the tp group, as the dense MLP) u = t and ep takes
the innermost ranks of dp_shard x cp, cp first (torchtitan's order): pp2 x cp2 x ep2 needs 4 ranks,
not 8; with etp = 1 the experts are whole and ep takes tp's ranks too (tp innermost). The `ep` ranks
of one block (same pp, r, d, u) split each MoE layer's experts between them, exchanging tokens by
all-to-all; the ranks holding the same experts (same pp, e, u; every r and d) are the
expert-data-parallel group their gradients are reduced over: edp = dp_shard x cp x tp / (ep x etp),
times dp_replicate. Consecutive ranks keep an EP group inside one node while ep x etp <= the GPUs
per node. `fold_error` is the arithmetic's one-line refusal.

Pure Python: `mode=simulate` prints the rank table without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "edp", "ep", "etp")  # the experts' view of the same ranks


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
    ep: int = 1  # expert parallel: ranks borrowed from dp_shard x cp (and tp where etp = 1)
    cp: int = 1  # context parallel: a sequence's positions split across this many ranks
    etp: int = 0  # expert tensor parallel: 1 (experts whole) or tp (split as the dense MLP); 0: tp

    def __post_init__(self) -> None:
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        for name in (*DIMS, "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout degree {name} must be >= 1 (got {getattr(self, name)})")
        error = fold_error(dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, ep=self.ep, etp=self.etp)
        if error:
            raise ValueError(error)

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

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree inside one dp_replicate block: dp_shard x cp x tp / (ep x etp)."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int, int]:
        """The experts' mesh over the same ranks (EXPERT_DIMS)."""
        return (self.pp, self.dp_replicate, self.edp, self.ep, self.etp)

    def _expert_coords(self, rank: int) -> tuple[int, int, int, int, int]:
        rest, u = divmod(rank, self.etp)
        rest, e = divmod(rest, self.ep)
        rest, d = divmod(rest, self.edp)
        p, r = divmod(rest, self.dp_replicate)
        return p, r, d, e, u

    def _expert_rank(self, p: int, r: int, d: int, e: int, u: int) -> int:
        return (((p * self.dp_replicate + r) * self.edp + d) * self.ep + e) * self.etp + u

    def ep_index(self, rank: int) -> int:
        """Which of its EP group's expert blocks `rank` holds."""
        return self._expert_coords(rank)[3]

    def etp_index(self, rank: int) -> int:
        """Which slice of each of its experts' weights `rank` holds (0 when experts are whole)."""
        return self._expert_coords(rank)[4]

    def ep_ranks(self, rank: int) -> list[int]:
        """Global ranks exchanging tokens with `rank` in its MoE layers (its expert-parallel group), by ep index."""
        p, r, d, _, u = self._expert_coords(rank)
        return [self._expert_rank(p, r, d, e, u) for e in range(self.ep)]

    def edp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same experts as `rank` (its expert-data-parallel group), replica-major."""
        p, _, _, e, u = self._expert_coords(rank)
        return [self._expert_rank(p, r, d, e, u) for r in range(self.dp_replicate) for d in range(self.edp)]

    def batch_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same stages and tp index with other tokens (dp x cp): where per-token
        counts (the aux-free balance) are summed."""
        return self.dp_ranks(rank)

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
        etp = f" x etp={self.etp}" if self.etp > 1 else ""
        ep = f" (experts: ep={self.ep}{etp} x edp={self.edp * self.dp_replicate})" if self.ep > 1 else ""
        return " x ".join(parts) + f" = {self.world} ranks{ep}"

    @property
    def dp_mode(self) -> str:
        """none | replicate | shard | hsdp: how the gradients of one stage are reduced (context parallel
        shards the parameters over its ranks too, as torchtitan's fsdp = dp_shard x cp)."""
        if self.dp_shard * self.cp > 1:
            return "hsdp" if self.dp_replicate > 1 else "shard"
        return "replicate" if self.dp_replicate > 1 else "none"


def fold_error(*, dp_shard: int, cp: int, tp: int, ep: int, etp: int) -> str:
    """Why experts cannot fold over these degrees, in one line naming the knob ("" when they can). Still
    refused: 1 < etp < tp (part of tp splitting the experts, the rest borrowed by ep: not built), and
    etp = 1 with an ep group that does not take whole tp groups (its tp ranks hold the same tokens)."""
    if etp not in (1, tp):
        return (f"parallel.etp={etp} must be 1 (experts whole) or parallel.tp={tp} (each expert split as the dense "
                f"MLP): a part of tp splitting the experts and the rest borrowed by ep is not built")
    if etp == 1 and tp > 1 and ep % tp:
        return (f"parallel.etp=1 with parallel.tp={tp}: ep borrows tp's ranks whole (they hold the same tokens), so "
                f"parallel.ep={ep} must be a multiple of {tp}")
    room = dp_shard * cp * (tp // etp)
    if room % ep:
        over = " x ".join(f"{k}={v}" for k, v in (("dp_shard", dp_shard), ("cp", cp), ("tp", tp // etp))
                          if v > 1) or "nothing"
        return (f"parallel.ep={ep} borrows ranks of parallel.dp_shard x cp{' x tp' if etp < tp else ''} ({over} = "
                f"{room}): set parallel.ep to a divisor of {room}")
    return ""


def rank_rows(layout: Layout, stages_of: Sequence[Sequence[int]]) -> list[tuple[int, Coords, tuple[int, ...]]]:
    """(global rank, coordinates, stages it holds) for every rank; `stages_of[p]`: the
    placement's stages of pipeline rank p."""
    return [(r, layout.coords(r), tuple(stages_of[layout.coords(r).pp])) for r in range(layout.world)]
