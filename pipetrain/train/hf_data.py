"""data=datasets: documents read through Hugging Face `datasets`, tokenized once into a cached
token stream, served as rows whose order is a pure function of (trainer.seed, step).

The stream. Every document of data.path's data.split (config/hf_source.py opens it) becomes
`[BOS] ids EOS` (BOS with data.add_bos), in the source's row order; documents with no tokens are
dropped. A document therefore starts at the stream's start and after every EOS, so a row's token
ids alone tell where its documents begin (what a block-causal document mask needs). Validation is
data.val_split's documents, or else the last data.val_fraction of the stream cut at a document
start: whole documents, never shared with training.

The cache. The stream is written once to `<cache>/pipetrain-packed/<key>/` (cache: $HF_DATASETS_CACHE,
else `datasets`' own cache folder), key = sha256 of (the source's files with their sizes and mtimes,
or the Arrow files a hub dataset was downloaded to; split, val_split, val_fraction, text_field; the tokenizer's name
and file sha256; add_bos). Every rank calls `build_hf_data`; the first to take the key's flock
builds the stream into a temporary folder and renames it into place, the others wait on the lock
and then memory-map it. Why the ranks and not the launcher: a local, torchrun and SLURM launch
all reach this same line, while only the local launcher has one process before the ranks; and a
resume, or another run on the same source, finds the folder and tokenizes nothing.

The rows. data.packing=true: row r is the stream's tokens [r(T+1), (r+1)(T+1)) (T = data.seq_len;
the last partial row is dropped), inputs its first T and targets its last T. data.packing=false:
row r is document r's first T + 1 tokens, padded with EOS, the padded targets -1 (counted in no
loss). Rows are visited in a permutation of all R rows seeded by (trainer.seed, epoch, split):
step k is epoch e = k // S, S = R // B steps an epoch (B = data.batch_size), and its global rows
are positions [(k % S) B, (k % S + 1) B) of epoch e's permutation. So the batch of step k is a
pure function of (seed, k), a resume at any dp degree repeats it, and the dp ranks (which take
contiguous slices of the global rows, parallel/dp.py: local_rows) never read the same row within
an epoch. At an epoch boundary the R - S B rows left over by epoch e's permutation are not read in
that epoch (a step never spans two epochs); epoch e + 1 starts a new permutation, in which they
are as likely as any other row to come first. Validation batches follow the same rule over the
validation rows (cycling within a batch when there are fewer than B).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from pipetrain.config.data import DataConfig
from pipetrain.config.data_sources import SourceConfig
from pipetrain.config.hf_source import HFSource, find_source, texts
from pipetrain.config.token_origin import origin
from pipetrain.metrics.names import data_metrics
from pipetrain.models.causal_lm import IGNORE_INDEX
from pipetrain.runtime.batch import Batch
from pipetrain.train.tokenizer import TextTokenizer

CACHE_VERSION = 1  # bump when the stream's layout changes: old caches are then never read
ENCODE_BATCH = 1000  # documents per encode_batch call (the hf tokenizer encodes a batch in parallel)


def cache_root() -> Path:
    """$HF_DATASETS_CACHE when set (read now, not at `datasets`' import), else `datasets`' cache folder."""
    env = os.environ.get("HF_DATASETS_CACHE")
    if env:
        return Path(env).expanduser()
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE)


def bos_eos(cfg: DataConfig, tok: TextTokenizer) -> tuple[Optional[int], int]:
    """(BOS id or None, EOS id) of the stream; one line when add_bos or packing needs a token it lacks."""
    if tok.eos_id is None:
        raise ValueError(f"data.tokenizer={tok.name} ({cfg.tokenizer_dir}) has no end-of-text token to separate "
                         "documents: add eos_token to its tokenizer_config.json")
    if cfg.add_bos and tok.bos_id is None:
        raise ValueError(f"data.add_bos=true but data.tokenizer={tok.name} has no beginning-of-text token: set "
                         "data.add_bos=false (documents are still separated by EOS)")
    return (tok.bos_id if cfg.add_bos else None), tok.eos_id


def stream_key(cfg: DataConfig, source: HFSource, tok: TextTokenizer, extra: str = "") -> str:
    """The cache key: what the stream is a function of (module docstring)."""
    made = origin(tok.name, cfg.tokenizer_dir)
    parts = [CACHE_VERSION, source.fingerprint(), extra, cfg.split, cfg.val_split, cfg.val_fraction, cfg.text_field,
             made["tokenizer"], made["sha256"], cfg.add_bos]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


Writer = Callable[[DataConfig, HFSource, TextTokenizer, Path], None]


def cached_stream(cfg: DataConfig, tok: TextTokenizer, *, writer: Optional[Writer] = None,
                  key: str = "") -> tuple[Path, dict[str, Any]]:
    """The folder of the tokenized stream and its meta.json, built now unless another process has
    (or is building it: then this waits on its lock). `writer`: what writes it (write_stream; data=sft's
    train/hf_sft.py writes rendered chats with their loss flags), `key`: what else the stream is a function of."""
    source = find_source(cfg.path or "")
    # a hub dataset: the Arrow files `datasets` downloaded it to (their names carry its revision's hash)
    extra = json.dumps([f["filename"] for f in source.open(cfg.split).cache_files]) if source.kind == "hub" else ""
    folder = cache_root() / "pipetrain-packed" / stream_key(cfg, source, tok, extra + key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (folder / "meta.json").is_file():
            partial = folder.with_suffix(".partial")
            shutil.rmtree(partial, ignore_errors=True)  # a build killed half-way
            partial.mkdir()
            (writer or write_stream)(cfg, source, tok, partial)
            partial.rename(folder)
    return folder, json.loads((folder / "meta.json").read_text())


def write_stream(cfg: DataConfig, source: HFSource, tok: TextTokenizer, out: Path) -> None:
    """Tokenize data.split (and data.val_split) into out/train.bin (out/val.bin) and out/meta.json."""
    bos, eos = bos_eos(cfg, tok)
    dtype = np.dtype("<u2" if tok.vocab_size <= 1 << 16 else "<u4")
    meta: dict[str, Any] = {"path": cfg.path, "tokenizer": tok.name, "eos_id": eos, "bos_id": bos,
                            "dtype": dtype.str, "splits": {}}
    for split, file in ((cfg.split, "train.bin"), *([(cfg.val_split, "val.bin")] if cfg.val_split else [])):
        docs = dropped = tokens = 0
        with open(out / file, "wb") as f:
            for column in texts(source.open(split), where=f"data.path={cfg.path}", text_field=cfg.text_field,
                                batch=ENCODE_BATCH):
                present = [t for t in column if t]
                dropped += len(column) - len(present)
                for ids in tok.encode_batch(present):
                    if not ids:
                        dropped += 1
                        continue
                    doc = np.asarray([*([bos] if bos is not None else []), *ids, eos], dtype=dtype)
                    f.write(doc.tobytes())
                    docs, tokens = docs + 1, tokens + len(doc)
        if docs == 0:
            raise ValueError(f"data.path={cfg.path} split {split!r} holds no text ({dropped:,} rows, all empty in "
                             f"{cfg.text_field!r}): give a source with documents, or set data.text_field")
        meta["splits"][file] = {"split": split, "documents": docs, "tokens": tokens, "dropped": dropped}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def doc_starts(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Where each document of a stream starts: 0 and after every EOS but the last token."""
    ends = np.flatnonzero(tokens == eos) + 1
    return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)


Spans = tuple[np.ndarray, np.ndarray]  # (starts, ends) of rows in a stream, int64 each


def doc_spans(tokens: np.ndarray, eos: int) -> Spans:
    """Each document of a stream as (starts, ends): a document a row (packing=false)."""
    starts = doc_starts(tokens, eos)
    return starts, np.append(starts[1:], len(tokens))


def holdout(tokens: np.ndarray, eos: int, val_fraction: float) -> int:
    """Where validation starts: the first document start at or after (1 - val_fraction) of the
    stream (len(tokens) when nothing is held out)."""
    if val_fraction == 0:
        return len(tokens)
    target = int(len(tokens) * (1 - val_fraction))
    starts = doc_starts(tokens, eos)
    later = starts[starts >= max(target, 1)]
    return int(later[0]) if later.size else len(tokens)


class PackedRows:
    """Rows of one or two token streams (train, val), in the seeded epoch order of the module docstring."""

    def __init__(self, parts: dict[str, np.ndarray], *, batch_size: int, seq_len: int, seed: int, packing: bool,
                 eos_id: int, what: str, name: str = "source", min_rows: Optional[int] = None,
                 spans: Optional[dict[str, Spans]] = None, loss: Optional[dict[str, np.ndarray]] = None) -> None:
        """`spans`: each split's rows as (starts, ends) of its stream instead of a document a row (data=sft:
        whole samples packed into rows, train/hf_sft.py); `loss`: each split's per-token loss flags (0: the
        token is no target), aligned with `parts`. Both only with packing=false."""
        assert packing is False or (spans is None and loss is None), "spans and loss flags are rows of whole spans"
        self.parts, self.batch_size, self.seq_len, self.seed = parts, batch_size, seq_len, seed
        self.packing, self.eos_id, self.what, self.name = packing, eos_id, what, name
        self.loss = loss or {}
        self.last_stats: dict[str, float] = {}  # the data/ metrics of the last training batch (metrics/names.py)
        # packing=false: row d of a split is [starts[d], ends[d]) of its stream (a document, or `spans`' rows)
        self.docs: dict[str, Spans] = spans or ({s: doc_spans(t, eos_id) for s, t in parts.items()}
                                                if not packing else {})
        self._perm: dict[str, tuple[int, torch.Tensor]] = {}  # split -> (epoch, permutation): the last one drawn
        rows = {s: self.num_rows(s) for s in parts}
        least = batch_size if min_rows is None else min_rows  # a mixture's source needs a row, not a batch
        if rows["train"] < least:
            unit = f"rows of data.seq_len + 1 = {seq_len + 1} tokens" if packing else "documents"
            lower = [*(["data.batch_size"] if min_rows is None else []), *(["data.seq_len"] if packing else [])]
            need = f"data.batch_size={batch_size}" if min_rows is None else "one (a mixture with no rows)"
            raise ValueError(f"{what} holds {rows['train']:,} training {unit}, fewer than {need}: "
                             + (f"lower {' or '.join(lower)}, or " if lower else "") + "use more data")
        if "val" in parts and rows["val"] == 0:
            raise ValueError(f"{what}: the validation split holds no row of {seq_len + 1} tokens: raise "
                             "data.val_fraction, lower data.seq_len, or set data.val_fraction=0")
        held = {s: int((self.docs[s][1] - self.docs[s][0]).sum()) if spans else len(t) for s, t in parts.items()}
        self.description = (f"{what}: train {held['train']:,} tokens, {rows['train']:,} rows"
                            + (f"; val {held['val']:,} tokens, {rows['val']:,} rows" if "val" in parts else "")
                            + f" ({'packed' if packing else 'whole samples a row' if spans else 'a document a row'}"
                            f", {self.steps_per_epoch:,} steps an epoch)")

    def num_rows(self, split: str) -> int:
        if self.packing:
            return len(self.parts[split]) // (self.seq_len + 1)
        return len(self.docs[split][0])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows("train") // self.batch_size

    def row_ids(self, step: int, split: str = "train") -> np.ndarray:
        """The global rows of `step` (B,): positions [j B, (j + 1) B) of its epoch's permutation."""
        if split not in self.parts:
            raise ValueError(f"{self.what} has no {split} split: set data.val_fraction > 0 (e.g. 0.1), "
                             "data.val_split, or trainer.eval_every=0")
        rows, b = self.num_rows(split), self.batch_size
        per_epoch = max(rows // b, 1)
        epoch, j = divmod(step, per_epoch)
        if self._perm.get(split, (None,))[0] != epoch:
            digest = hashlib.blake2b(f"pipetrain-rows/{self.seed}/{split}/{epoch}".encode(), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            self._perm[split] = (epoch, torch.randperm(rows, generator=g))
        positions = (np.arange(j * b, (j + 1) * b)) % rows  # wraps only when a split has fewer rows than B (val)
        return self._perm[split][1].numpy()[positions]

    def batch(self, step: int, *, split: str = "train") -> Batch:
        x, y, real = self.rows(split, self.row_ids(step, split))
        if split == "train":
            self.last_stats = data_metrics(tokens=int(real.sum()), loss_tokens=int((y != IGNORE_INDEX).sum()),
                                           positions=y.numel(), per_source={self.name: int(real.sum())})
        return x, y

    def rows(self, split: str, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(inputs (n, T), targets (n, T), each row's input tokens that are not padding (n,)) of rows `ids`."""
        t1 = self.seq_len + 1
        tokens = self.parts[split]
        if self.packing:
            window = tokens[ids[:, None] * t1 + np.arange(t1)].astype(np.int64)  # (n, T + 1)
            x = torch.from_numpy(window)
            return x[:, :-1].contiguous(), x[:, 1:].contiguous(), np.full(len(ids), self.seq_len)
        starts, ends = self.docs[split]
        flags = self.loss.get(split)
        window = np.full((len(ids), t1), self.eos_id, dtype=np.int64)  # (n, T + 1)
        target = np.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=np.int64)  # (n, T)
        real = np.zeros(len(ids), dtype=np.int64)
        for i, d in enumerate(ids):
            doc = tokens[starts[d]:min(ends[d], starts[d] + t1)]
            window[i, :len(doc)] = doc
            target[i, :len(doc) - 1] = doc[1:]
            if flags is not None:  # a token the loss skips (data=sft: not the assistant's) is no target
                target[i, :len(doc) - 1][flags[starts[d] + 1:starts[d] + len(doc)] == 0] = IGNORE_INDEX
            real[i] = min(len(doc), self.seq_len)
        return torch.from_numpy(window[:, :-1]).contiguous(), torch.from_numpy(target), real


def source_rows(cfg: DataConfig, source: SourceConfig, tok: TextTokenizer, *, seed: int, what: str,
                min_rows: Optional[int] = None) -> PackedRows:
    """One source's cached stream (built here by the first process to come), memory-mapped, as rows."""
    one = copy.copy(cfg)  # data.* with this source's path, split and text field (not checked again)
    one.path, one.split, one.text_field, one.sources = source.path, source.split, source.text_field, []
    folder, meta = cached_stream(one, tok)
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(folder / "train.bin", dtype=dtype, mode="r")
    parts = {"train": train}
    if (folder / "val.bin").is_file():
        parts["val"] = np.memmap(folder / "val.bin", dtype=dtype, mode="r")
    else:
        cut = holdout(train, meta["eos_id"], cfg.val_fraction)
        parts = {"train": train[:cut], **({"val": train[cut:]} if cut < len(train) else {})}
    return PackedRows(parts, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed, packing=cfg.packing,
                      eos_id=meta["eos_id"], what=what, name=source.label, min_rows=min_rows)
