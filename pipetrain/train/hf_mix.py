"""data.sources: a weighted mixture of `datasets` sources, each row of the global batch read from one.

Which source a row reads (`MixPlan`). Let p_i = weight_i / sum and B = data.batch_size. Steps are
grouped in blocks of G = ceil(1 / (B min p_i)) steps (G = 1 whenever every source gets at least one
row a step), N = G B rows a block. The rows of source i in blocks 0..g-1 are

    C_i(g) = floor(g N P_{i+1} + 1/2) - floor(g N P_i + 1/2),    P_i = p_0 + ... + p_{i-1},

in exact rational arithmetic: they sum to g N, stay within one row of g N p_i (so the share of source i
in the rows, and with packing in the tokens, is p_i to within 1 / (g N)), and never decrease (each
block gives source i floor(N P_{i+1}) - ceil(N P_i) >= 0 rows as N p_i >= 1). Block g's N rows are
C_i(g + 1) - C_i(g) rows of each source, in an order shuffled by a generator seeded by
(trainer.seed, split, g); step k is rows [(k mod G) B, (k mod G + 1) B) of its block k // G. So the
source of every row of step k, and how many rows each source gave before it (its counter), are a pure
function of (seed, k), computed in O(N) without visiting earlier steps.

How a source's position advances, and what its epoch is. Row m of source i (m: its counter) is row
m mod R_i of source i's epoch m // R_i (R_i: its rows, train/hf_data.py: PackedRows), read in a
permutation seeded by (seed, i, split, epoch): an epoch of a source is every one of its R_i rows read
once, and a source with a larger share than its size goes through its epochs faster. No row is
skipped at an epoch's end (unlike a single source's epochs, which end on a whole step). The dp ranks
take contiguous slices of the same global rows (parallel/dp.py: local_rows), so two ranks read the
same row of a source within its epoch only if that epoch is shorter than one step's rows of it.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from typing import Sequence

import numpy as np
import torch

from pipetrain.metrics.names import data_metrics
from pipetrain.models.causal_lm import IGNORE_INDEX
from pipetrain.runtime.batch import Batch
from pipetrain.train.hf_data import PackedRows


def seeded(*parts: object) -> torch.Generator:
    """A CPU generator seeded from `parts` by a stable hash (every process and run agrees)."""
    digest = hashlib.blake2b("/".join(map(str, ("pipetrain-mix", *parts))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class MixPlan:
    """The source of each global row of a step, and each source's counter there (module docstring)."""

    def __init__(self, weights: Sequence[float], *, batch_size: int, seed: int, split: str = "train") -> None:
        shares = [Fraction(w) for w in weights]  # exact: a float is a dyadic rational
        total = sum(shares, Fraction(0))
        self.cum = [sum(shares[:i], Fraction(0)) / total for i in range(len(shares) + 1)]  # P_0 .. P_S
        self.batch_size, self.seed, self.split = batch_size, seed, split
        self.group = math.ceil(total / (batch_size * min(shares)))  # G steps a block
        self.block_rows = self.group * batch_size  # N
        self._block: tuple[int, np.ndarray, np.ndarray] = (-1, np.empty(0), np.empty(0))

    def before(self, block: int) -> np.ndarray:
        """C_i(block): rows of each source in the blocks before `block` (S,)."""
        n = block * self.block_rows
        edges = [math.floor(n * c + Fraction(1, 2)) for c in self.cum]
        return np.diff(np.asarray(edges, dtype=np.int64))

    def _pattern(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(the source of each of the block's N rows, each row's counter in its source)."""
        if self._block[0] != block:
            start, counts = self.before(block), self.before(block + 1) - self.before(block)
            order = torch.randperm(self.block_rows, generator=seeded(self.seed, self.split, block)).numpy()
            source = np.repeat(np.arange(len(counts)), counts)[order]  # (N,)
            counter = np.empty(self.block_rows, dtype=np.int64)
            for i in range(len(counts)):
                mine = source == i
                counter[mine] = start[i] + np.arange(int(mine.sum()))
            self._block = (block, source, counter)
        return self._block[1], self._block[2]

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source (B,), counter (B,)) of the global rows of `step`."""
        block, j = divmod(step, self.group)
        source, counter = self._pattern(block)
        cut = slice(j * self.batch_size, (j + 1) * self.batch_size)
        return source[cut], counter[cut]


class MixedRows:
    """data.sources without streaming: each source's cached stream as rows (PackedRows), mixed by MixPlan."""

    def __init__(self, sources: list[PackedRows], weights: Sequence[float], *, names: list[str], seed: int) -> None:
        self.sources, self.names, self.seed = sources, names, seed
        self.batch_size = sources[0].batch_size
        splits = ["train", *(["val"] if all("val" in s.parts for s in sources) else [])]
        self.plans = {split: MixPlan(weights, batch_size=self.batch_size, seed=seed, split=split) for split in splits}
        self._orders: dict[tuple[int, str, int], np.ndarray] = {}
        self.last_stats: dict[str, float] = {}
        total = sum(weights)
        self.description = "mixture: " + "; ".join(
            f"{n} {w / total:.0%} ({s.num_rows('train'):,} rows)" for n, w, s in zip(names, weights, sources)) + (
            f" (the weights hold to a row every {self.plans['train'].group} step(s))")

    def _order(self, i: int, split: str, epoch: int) -> np.ndarray:
        key = (i, split, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.sources):  # the epochs in use only
                self._orders.clear()
            rows = self.sources[i].num_rows(split)
            self._orders[key] = torch.randperm(rows, generator=seeded(self.seed, "order", i, split, epoch)).numpy()
        return self._orders[key]

    def batch(self, step: int, *, split: str = "train") -> Batch:
        if split not in self.plans:
            raise ValueError("data.sources: some source has no validation split: set data.val_fraction > 0 (e.g. "
                             "0.1), data.val_split, or trainer.eval_every=0")
        source, counter = self.plans[split].rows(step)
        t = self.sources[0].seq_len
        x = torch.empty((len(source), t), dtype=torch.long)  # (B, T)
        y = torch.empty((len(source), t), dtype=torch.long)
        per_source: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            mine = np.flatnonzero(source == i)
            rows = src.num_rows(split)
            ids = np.asarray([self._order(i, split, int(m // rows))[m % rows] for m in counter[mine]], dtype=np.int64)
            xi, yi, real = src.rows(split, ids)
            x[mine], y[mine] = xi, yi
            per_source[self.names[i]] = int(real.sum())
        if split == "train":
            self.last_stats = data_metrics(tokens=sum(per_source.values()), loss_tokens=int((y != IGNORE_INDEX).sum()),
                                           positions=y.numel(), per_source=per_source)
        return x, y
