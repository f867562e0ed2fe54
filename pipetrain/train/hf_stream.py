"""data.streaming=true: documents read through `datasets` streaming (an IterableDataset), tokenized and
packed as they are read, with the position saved in each checkpoint.

A source is read in its own order (no shuffle: a streamed corpus is shuffled when it is written, as
torchtitan's HF datasets assume), each document becoming `[BOS] ids EOS` as in train/hf_data.py.
With data.packing=true a row is the next data.seq_len + 1 tokens of that stream (a document split
across two rows continues in the next row the source gives); with false it is the next document's
first seq_len + 1 tokens, padded. When a source ends, its next epoch reads it again from its first
document (a partial row carries over). Which source each global row reads is the same MixPlan as
without streaming (train/hf_mix.py: a pure function of (seed, step)); what the row holds is the
source's next row, so the batches are a function of (seed, step) and of the sources' positions.

The position (`state_dict`): the next step, and per source the epoch, the documents consumed in
it and the leftover tokens of its partial row. A resume restores it and reopens each source with
`skip(documents)` (which reads and drops them: O(documents) but exact for any source `datasets`
streams), so it repeats the uninterrupted run's batches. Every rank reads the same global stream
and keeps its rows (parallel/dp.py: local_rows), so no two dp (or cp) ranks read the same row and
a resume at another dp degree repeats the batches too; the cost is that each rank tokenizes every
row of the global batch.

Validation: data.val_split's documents when set, else the documents whose index in the source
hashes below data.val_fraction (decided without knowing the source's length; training skips
them). A validation pass reads from the start of the held-out documents each time, so eval batch
i is a function of (seed, i).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np
import torch

from pipetrain.config.data import DataConfig
from pipetrain.config.data_sources import SourceConfig
from pipetrain.config.hf_source import find_source
from pipetrain.metrics.names import data_metrics
from pipetrain.models.causal_lm import IGNORE_INDEX
from pipetrain.runtime.batch import Batch
from pipetrain.train.hf_data import bos_eos
from pipetrain.train.hf_mix import MixPlan
from pipetrain.train.tokenizer import TextTokenizer


def held_out(doc: int, val_fraction: float) -> bool:
    """Whether document `doc` of a source (its index, from 0) is validation: a stable hash of the index."""
    h = int.from_bytes(hashlib.blake2b(f"pipetrain-val/{doc}".encode(), digest_size=8).digest(), "little")
    return h / 2**64 < val_fraction


class SourceStream:
    """One source's documents, in order, as rows of seq_len + 1 tokens; `docs` / `epoch` / `leftover`
    are its position."""

    def __init__(self, source: SourceConfig, split: str, *, tok: TextTokenizer, seq_len: int, packing: bool,
                 keep: str, val_fraction: float, cfg: DataConfig) -> None:
        self.source, self.split, self.tok = source, split, tok
        self.seq_len, self.packing = seq_len, packing
        self.bos, self.eos = bos_eos(cfg, tok)
        self.keep, self.val_fraction = keep, val_fraction  # keep: all | train | val (by held_out)
        self.docs, self.epoch, self.leftover = 0, 0, []  # the position
        self._it: Optional[Any] = None

    def state(self) -> dict[str, Any]:
        return {"name": self.source.label, "epoch": self.epoch, "docs": self.docs, "leftover": list(self.leftover)}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.docs, self.leftover, self._it = state["epoch"], state["docs"], list(state["leftover"]), None

    def _next_text(self) -> str:
        """The next document's text of the kept ones, opening (or reopening, at an epoch's end) the stream."""
        from_start = self.docs == 0  # a whole pass from the first document that keeps nothing: refused
        while True:
            if self._it is None:
                ds = find_source(self.source.path).open(self.split, streaming=True)
                self._it = iter(ds.skip(self.docs) if self.docs else ds)
            row = next(self._it, None)
            if row is None:  # the source's end: its next epoch
                if from_start:
                    raise ValueError(f"data: {self.source.path} split {self.split!r} holds no document to read"
                                     f"{'' if self.keep == 'all' else f' as {self.keep}'}: give a source with "
                                     "documents (or change data.val_fraction)")
                self.epoch, self.docs, self._it, from_start = self.epoch + 1, 0, None, True
                continue
            index, self.docs = self.docs, self.docs + 1
            text = row.get(self.source.text_field)
            if text is not None and not isinstance(text, str):
                raise ValueError(f"data: {self.source.path} row {index} has a {type(text).__name__} in "
                                 f"{self.source.text_field!r}, not a string: set text_field to the field with the text")
            if self.keep != "all" and held_out(index, self.val_fraction) != (self.keep == "val"):
                continue
            if text:
                return text

    def _next_doc(self) -> list[int]:
        while True:
            ids = self.tok.encode(self._next_text())
            if ids:
                return [*([self.bos] if self.bos is not None else []), *ids, self.eos]

    def next_row(self) -> tuple[list[int], int]:
        """(the next row's seq_len + 1 tokens, how many of them are the document's: the rest is padding)."""
        t1 = self.seq_len + 1
        if not self.packing:
            doc = self._next_doc()[:t1]
            return doc + [self.eos] * (t1 - len(doc)), len(doc)
        while len(self.leftover) < t1:
            self.leftover.extend(self._next_doc())
        row, self.leftover = self.leftover[:t1], self.leftover[t1:]
        return row, t1


class StreamRows:
    """data=datasets with streaming: the global batch of each step, read in step order (module docstring)."""

    def __init__(self, cfg: DataConfig, sources: list[SourceConfig], tok: TextTokenizer, *, seed: int) -> None:
        self.cfg, self.sources, self.tok, self.seed = cfg, sources, tok, seed
        self.batch_size, self.seq_len = cfg.batch_size, cfg.seq_len
        weights = [s.weight for s in sources]
        self.plans = {split: MixPlan(weights, batch_size=cfg.batch_size, seed=seed, split=split)
                      for split in ("train", "val")}
        held = "train" if cfg.val_fraction > 0 and not cfg.val_split else "all"
        self.streams = [self._stream(s, s.split or cfg.split, held) for s in sources]
        self.next_step = 0
        self._last: Optional[tuple[int, Batch, dict[str, float]]] = None
        self._val: dict[int, tuple[SourceStream, list[tuple[list[int], int]]]] = {}  # rows read from the start
        self.last_stats: dict[str, float] = {}
        self.description = (f"streaming {', '.join(f'{s.label} {s.path}' for s in sources)} ({tok.name} tokens, "
                            f"{'packed' if cfg.packing else 'a document a row'}; read in order, position saved in "
                            "checkpoints)")

    def _stream(self, s: SourceConfig, split: str, keep: str) -> SourceStream:
        return SourceStream(s, split, tok=self.tok, seq_len=self.seq_len, packing=self.cfg.packing,
                            keep=keep, val_fraction=self.cfg.val_fraction, cfg=self.cfg)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last step read (saved in each checkpoint's meta.json: data_state)."""
        return {"next_step": self.next_step, "sources": [s.state() for s in self.streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [s.label for s in self.sources]
        saved = [s["name"] for s in state["sources"]]
        if saved != names:
            raise ValueError(f"trainer.resume: the checkpoint streamed the sources {saved}, this run {names}: a stream "
                             "position holds for the same sources only; set data.sources back, or start a new run")
        for stream, s in zip(self.streams, state["sources"]):
            stream.restore(s)
        self.next_step, self._last = state["next_step"], None

    def batch(self, step: int, *, split: str = "train") -> Batch:
        if split == "val":
            return self._val_batch(step)
        if self._last is not None and self._last[0] == step:  # asked again within the step
            self.last_stats = self._last[2]
            return self._last[1]
        if step != self.next_step:
            raise RuntimeError(f"streaming data reads steps in order: step {step} asked, the stream is at step "
                               f"{self.next_step} (a resume restores the position from the checkpoint)")
        source, _ = self.plans["train"].rows(step)
        rows = [self.streams[i].next_row() for i in source]
        batch, self.last_stats = self._assemble(rows, source)
        self._last, self.next_step = (step, batch, self.last_stats), step + 1
        return batch

    def _val_batch(self, i: int) -> Batch:
        if self.cfg.val_fraction == 0 and not self.cfg.val_split:
            raise ValueError("data.streaming has no validation documents with data.val_fraction=0: set "
                             "data.val_fraction > 0, data.val_split, or trainer.eval_every=0")
        source, counter = self.plans["val"].rows(i)
        rows = []
        for s, m in zip(source, counter):
            if s not in self._val:
                keep = "all" if self.cfg.val_split else "val"
                self._val[s] = (self._stream(self.sources[s], self.cfg.val_split or self.streams[s].split, keep), [])
            stream, read = self._val[s]
            while len(read) <= m:
                read.append(stream.next_row())
            rows.append(read[m])
        return self._assemble(rows, source)[0]

    def _assemble(self, rows: list[tuple[list[int], int]], source: np.ndarray) -> tuple[Batch, dict[str, float]]:
        window = torch.tensor([r for r, _ in rows], dtype=torch.long)  # (B, T + 1)
        x, y = window[:, :-1].contiguous(), window[:, 1:].clone()
        for r, (_, length) in enumerate(rows):  # a padded row's targets past its document are not trained on
            y[r, length - 1:] = IGNORE_INDEX
        real = [min(length, self.seq_len) for _, length in rows]  # input positions holding the document
        per_source = {s.label: sum(n for n, i in zip(real, source) if i == k) for k, s in enumerate(self.sources)}
        stats = data_metrics(tokens=sum(real), loss_tokens=int((y != IGNORE_INDEX).sum()), positions=y.numel(),
                             per_source=per_source)
        return (x, y), stats
