"""Batches for training and validation, a pure function of (seed, step, split).

`build_data(config.data, seed=..., vocab_size=..., model=...)` returns a `DataSource`;
`source.batch(k)` is the whole batch of optimizer step k, `(inputs, targets)` each of shape
(data.batch_size, data.seq_len), and `split_microbatches` cuts it into the pipeline's
microbatches. Nothing is stateful: the batch of step k is drawn by a generator seeded from
(seed, k, split) alone, so a resumed run (at any pipeline degree) sees exactly the data it
would have seen, and every rank can draw step k itself and feed the microbatches it needs.

Token data follow nanoGPT's `get_batch` (train.py): batch_size random windows of seq_len + 1
tokens, inputs the first seq_len and targets the same window shifted by one. Validation
windows come from separate validation shards (data.val_path, or a folder's val-named shards)
or else from the last data.val_fraction of the stream, cut once, so train and validation
windows never share a token. Shards are memory-mapped and read as one stream without being
concatenated (`ShardStream`). `eval_tokens` is the token stream mode=eval reads. Models
that do not read token ids (mlp, sleep) get their own `example_batch`.
"""

from __future__ import annotations

import gzip
import os
import hashlib
import importlib.resources
from typing import Any, Optional, Protocol, Union

import numpy as np
import torch

from pipetrain.config.data import BYTE_VOCAB, DataConfig, split_sizes
from pipetrain.config.shards import Shard
from pipetrain.train.token_check import FULL_SCAN_TOKENS  # up to it, the vocabulary check reads all data up front
from pipetrain.train.tokenizer import load_tokenizer
from pipetrain.runtime.batch import Batch

SPLITS = ("train", "val")
CORPUS_FILE = "corpus/stdlib_docs.txt.gz"  # package data of pipetrain.train; provenance in corpus/README.md


class DataSource(Protocol):
    description: str  # one line for the run log: what, how many tokens, the split

    def batch(self, step: int, *, split: str = "train") -> Batch:
        """(inputs, targets) of optimizer step `step`: a pure function of (seed, step, split)."""
        ...


def step_generator(seed: int, step: int, split: str) -> torch.Generator:
    """A CPU generator seeded from (seed, step, split) alone. A stable hash (not Python's
    per-process salted hash()) so every process and every run agrees."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)} (got {split!r})")
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    digest = hashlib.blake2b(f"pipetrain-data/{seed}/{split}/{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits: a valid seed


class ShardStream:
    """Memory-mapped shards read as one 1-D token stream, in order, never concatenated in memory:
    index i of the stream is index i - starts[s] of shard s, starts[s] <= i < starts[s + 1]."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.starts = np.cumsum([0, *(len(a) for a in arrays)])  # (S + 1,)
        self.dtype = np.result_type(*(a.dtype for a in arrays))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx: Union[slice, np.ndarray]) -> np.ndarray:
        """Tokens at integer positions `idx` (any shape) or a slice, as an array of the same shape."""
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx)
        out = np.empty(idx.shape, dtype=self.dtype)
        which = np.searchsorted(self.starts, idx, side="right") - 1  # the shard of every position
        for s in np.unique(which):
            sel = which == s
            out[sel] = read_mapped(self.arrays[s], idx[sel] - self.starts[s])
        return out

    def max(self) -> int:
        return max(int(a.max()) for a in self.arrays)

    def min(self) -> int:
        return min(int(a.min()) for a in self.arrays)


Tokens = Union[np.ndarray, ShardStream]  # a 1-D token stream: len(), [index array], [slice], .max(), .min()


def read_mapped(tokens: Tokens, idx: np.ndarray) -> np.ndarray:
    """tokens[idx], where a memory-mapped token file is first checked to still hold what was mapped:
    reading a page past the end of a file that shrank under the running job (rewritten, truncated)
    kills the process with SIGBUS and no word of which file; this is one line naming it. One stat
    per file a batch reads from."""
    name = getattr(tokens, "filename", None)
    if name is not None:
        need = tokens.offset + tokens.nbytes
        size = os.stat(name).st_size
        if size < need:
            raise ValueError(f"{name} shrank under the running job ({size:,} bytes, {need:,} were mapped): a run's "
                             f"token files must not change while it trains; restore the file (or point data.path "
                             f"at a new copy and resume)")
    return tokens[idx]


class TokenWindows:
    """Random windows over a token stream; validation windows from `val_tokens` when given,
    else from the last `val_fraction` of `tokens`."""

    def __init__(self, tokens: Tokens, *, batch_size: int, seq_len: int, val_fraction: float, seed: int,
                 vocab_size: int, what: str, val_tokens: Optional[Tokens] = None) -> None:
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.vocab_size, self.what = vocab_size, what
        if val_tokens is None:
            train, val = split_sizes(len(tokens), val_fraction)
            self.parts = {"train": (tokens, 0, train), "val": (tokens, train, len(tokens))}  # [lo, hi) ranges
            self.description = f"{what}: {len(tokens):,} tokens (train {train:,}, val {val:,})"
        else:
            self.parts = {"train": (tokens, 0, len(tokens)), "val": (val_tokens, 0, len(val_tokens))}
            self.description = f"{what}: train {len(tokens):,} tokens, val {len(val_tokens):,} (separate shards)"
        for stream in {id(t): t for t, _, _ in self.parts.values()}.values():
            if len(stream) <= FULL_SCAN_TOKENS:  # else each batch is checked as it is drawn
                _check_vocab(int(stream.min()), int(stream.max()), vocab_size, what=what)

    def batch(self, step: int, *, split: str = "train") -> Batch:
        g = step_generator(self.seed, step, split)
        tokens, lo, hi = self.parts[split]
        if hi - lo < self.seq_len + 1:
            raise ValueError(f"{self.what} has no {split} split: set data.val_fraction > 0 (e.g. 0.1) "
                             "or trainer.eval_every=0")
        # A window [s, s + seq_len] lies inside [lo, hi): s in [lo, hi - seq_len).
        starts = torch.randint(lo, hi - self.seq_len, (self.batch_size,), generator=g).numpy()
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        window = torch.from_numpy(read_mapped(tokens, idx).astype(np.int64))  # (B, T + 1)
        _check_vocab(int(window.min()), int(window.max()), self.vocab_size, what=self.what, step=step)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T) each


class SyntheticTokens:
    """Uniform random token ids below vocab_size: the shape and cost of real data, nothing to learn."""

    def __init__(self, *, batch_size: int, seq_len: int, seed: int, vocab_size: int) -> None:
        self.batch_size, self.seq_len, self.seed, self.vocab_size = batch_size, seq_len, seed, vocab_size
        self.description = f"synthetic: uniform token ids < {vocab_size:,}"

    def batch(self, step: int, *, split: str = "train") -> Batch:
        g = step_generator(self.seed, step, split)
        window = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # targets shifted by one, as real text


class ModelExamples:
    """The model's own example batch (model=mlp, model=sleep: inputs are not token ids)."""

    def __init__(self, model: Any, *, batch_size: int, seq_len: int, seed: int) -> None:
        self.model, self.batch_size, self.seq_len, self.seed = model, batch_size, seq_len, seed
        self.description = f"synthetic: {type(model).__name__}.example_batch"

    def batch(self, step: int, *, split: str = "train") -> Batch:
        g = step_generator(self.seed, step, split)
        return self.model.example_batch(microbatch=self.batch_size, seq=self.seq_len, generator=g)


def build_data(cfg: DataConfig, *, seed: int, vocab_size: int, model: Any = None) -> DataSource:
    """The data source of `cfg` (config.data). `vocab_size` is model.vocab_size (token ids
    must be below it); `model`, when given, decides whether the inputs are token ids at all."""
    if model is not None and not takes_token_ids(model):
        if cfg.name in ("text", "tokens", "datasets", "sft"):
            raise ValueError(f"data={cfg.name} feeds token ids but model {type(model).__name__} does not read them: "
                             "use a GPT-2 model, or data=synthetic")
        return ModelExamples(model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed)
    if vocab_size < 1:
        raise ValueError(f"model.vocab_size must be >= 1 (got {vocab_size})")
    if cfg.name == "synthetic":
        return SyntheticTokens(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed, vocab_size=vocab_size)
    if cfg.name in ("datasets", "sft"):
        from pipetrain.train.hf_build import build_hf_data  # imports `datasets` only for data=datasets / sft

        return build_hf_data(cfg, seed=seed, vocab_size=vocab_size)
    cfg.check_vocab_fits(vocab_size)
    tokens, val_tokens = load_tokens(cfg), load_val_tokens(cfg)
    if cfg.uses_tokenizer:  # BPE lengths are known only now; byte and token-file lengths were checked already
        cfg.check_length(len(tokens))
    what = f"data.path={cfg.path}" if cfg.path else f"data={cfg.name}"
    if cfg.uses_tokenizer:
        what += f" ({cfg.tokenizer_name} tokens)"
    return TokenWindows(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, val_fraction=cfg.val_fraction,
                        seed=seed, vocab_size=vocab_size, what=what, val_tokens=val_tokens)


def split_microbatches(batch: Batch, microbatches: int) -> list[Batch]:
    """Cut (inputs, targets) along dim 0 into `microbatches` equal parts (views, no copy)."""
    x, y = batch
    size = x.shape[0]
    if microbatches < 1 or size % microbatches:
        raise ValueError(
            f"data.batch_size={size} does not split into pipeline.microbatches={microbatches} equal microbatches: "
            "set data.batch_size to a multiple of pipeline.microbatches"
        )
    per = size // microbatches
    return list(zip(x.split(per), y.split(per)))


def takes_token_ids(model: Any) -> bool:
    """Whether the model's input (boundary spec 0) is integer token ids, as GPT-2's."""
    return not model.boundary_specs(microbatch=1, seq=1)[0].dtype.is_floating_point


# ---- loading ----------------------------------------------------------------------------------


def builtin_corpus() -> bytes:
    """The built-in corpus (ASCII text), read from the installed package."""
    return gzip.decompress(importlib.resources.files("pipetrain.train").joinpath(CORPUS_FILE).read_bytes())


def open_shards(shards: list[Shard]) -> Tokens:
    """Shards as one token stream, each memory-mapped where its header says its tokens lie."""
    arrays = [np.memmap(s.path, dtype=np.dtype(s.dtype), mode="r", offset=s.offset, shape=(s.count,))
              for s in shards]
    return arrays[0] if len(arrays) == 1 else ShardStream(arrays)


def load_tokens(cfg: DataConfig) -> Tokens:
    """The (training) token stream of `cfg`: memory-mapped for data=tokens and for byte tokens
    of a text file (nothing read until a batch needs it), in memory otherwise."""
    if cfg.name == "tokens":
        return open_shards(cfg.token_shards()[0])
    if cfg.tokenizer_name == "byte":
        if cfg.name == "text":
            return np.memmap(cfg.file, dtype=np.uint8, mode="r")
        return np.frombuffer(builtin_corpus(), dtype=np.uint8)
    text = cfg.file.read_text(encoding="utf-8", errors="replace") if cfg.name == "text" else builtin_corpus().decode()
    tok = load_tokenizer(cfg.tokenizer_name, cfg.tokenizer_dir)
    return np.asarray(tok.encode(text), dtype=np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)


def load_val_tokens(cfg: DataConfig) -> Optional[Tokens]:
    """data=tokens: the separate validation shards (data.val_path, or a data.path folder's
    val-named shards) as one stream; None when the validation split is cut from the stream."""
    if cfg.name != "tokens":
        return None
    val = cfg.token_shards()[1]
    return open_shards(val) if val else None


def eval_tokens(cfg: DataConfig, *, vocab_size: int) -> Tokens:
    """The token stream mode=eval reads, whole: the validation shards (data.val_path, or a
    data.path folder's val-named shards), else all of data.path (or the text's tokens). Every
    id is checked against `vocab_size` (model.vocab_size) up to 128 Mi tokens."""
    cfg.check_vocab_fits(vocab_size)
    tokens = load_val_tokens(cfg)
    what = f"data.val_path={cfg.val_path}" if cfg.val_path else f"data.path={cfg.path}"
    if tokens is None:
        tokens = load_tokens(cfg)
        what = f"data.path={cfg.path}" if cfg.path else f"data={cfg.name}"
    if len(tokens) <= FULL_SCAN_TOKENS:
        _check_vocab(int(tokens.min()), int(tokens.max()), vocab_size, what=what)
    return tokens


def _check_vocab(min_id: int, max_id: int, vocab_size: int, *, what: str, step: int | None = None) -> None:
    at = "" if step is None else f" (in the batch of step {step})"
    if min_id < 0:  # an int64 .npy with -1 (an ignore or padding id) would index the embedding from its end
        raise ValueError(f"{what} has token id {min_id}{at}: token ids must be >= 0; drop the negative ids "
                         f"(padding or ignore markers) from the token files")
    if max_id < vocab_size:
        return
    raise ValueError(
        f"{what} has token id {max_id}{at} but model.vocab_size={vocab_size}: set model.vocab_size >= {max_id + 1} "
        f"(byte tokens need {BYTE_VOCAB}, GPT-2's BPE 50257)"
    )
