"""Batches for training and validation, a pure function of (seed, step, split).

`build_data(config.data, seed=..., vocab_size=..., model=...)` returns a `DataSource`;
`source.batch(k)` is the whole batch of optimizer step k, `(inputs, targets)` each of shape
(data.batch_size, data.seq_len), and `split_microbatches` cuts it into the pipeline's
microbatches. Nothing is stateful: the batch of step k is drawn by a generator seeded from
(seed, k, split) alone, so a resumed run (at any pipeline degree) sees exactly the data it
would have seen, and every rank can draw step k itself and feed the microbatches it needs.

Token data follow nanoGPT's `get_batch` (train.py): batch_size random windows of seq_len + 1
tokens, inputs the first seq_len and targets the same window shifted by one. The stream is
cut once, the last data.val_fraction held out, so train and validation windows never share
a token. Models that do not read token ids (mlp, sleep) get their own `example_batch`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pipetrain.config.data import BYTE_VOCAB, DataConfig, find_gpt2_encoder, split_sizes

Batch = tuple[torch.Tensor, torch.Tensor]
SPLITS = ("train", "val")
CORPUS_FILE = "corpus/stdlib_docs.txt.gz"  # package data of pipetrain.train; provenance in corpus/README.md
_FULL_SCAN_TOKENS = 1 << 27  # up to 128 Mi tokens the vocabulary check reads all data up front


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


class TokenWindows:
    """Random windows over one token stream (a numpy array or memory map of token ids)."""

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, val_fraction: float, seed: int,
                 vocab_size: int, what: str) -> None:
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.vocab_size, self.what = vocab_size, what
        train, val = split_sizes(len(tokens), val_fraction)
        self.bounds = {"train": (0, train), "val": (train, len(tokens))}  # [lo, hi) token ranges
        self.description = f"{what}: {len(tokens):,} tokens (train {train:,}, val {val:,})"
        if len(tokens) <= _FULL_SCAN_TOKENS:  # else each batch is checked as it is drawn
            _check_vocab(int(np.max(tokens)), vocab_size, what=what)

    def batch(self, step: int, *, split: str = "train") -> Batch:
        g = step_generator(self.seed, step, split)
        lo, hi = self.bounds[split]
        if hi - lo < self.seq_len + 1:
            raise ValueError(f"{self.what} has no {split} split: set data.val_fraction > 0 (e.g. 0.1) "
                             "or trainer.eval_every=0")
        # A window [s, s + seq_len] lies inside [lo, hi): s in [lo, hi - seq_len).
        starts = torch.randint(lo, hi - self.seq_len, (self.batch_size,), generator=g).numpy()
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        window = torch.from_numpy(self.tokens[idx].astype(np.int64))  # (B, T + 1)
        _check_vocab(int(window.max()), self.vocab_size, what=self.what, step=step)
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
        if cfg.name in ("text", "tokens"):
            raise ValueError(f"data={cfg.name} feeds token ids but model {type(model).__name__} does not read them: "
                             "use a GPT-2 model, or data=synthetic")
        return ModelExamples(model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed)
    if vocab_size < 1:
        raise ValueError(f"model.vocab_size must be >= 1 (got {vocab_size})")
    if cfg.name == "synthetic":
        return SyntheticTokens(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed, vocab_size=vocab_size)
    tokens = load_tokens(cfg)
    cfg.check_length(len(tokens))  # BPE lengths are known only now; byte and .bin lengths were checked already
    what = f"data.path={cfg.path}" if cfg.path else f"data={cfg.name}"
    if cfg.uses_tokenizer:
        what += f" ({cfg.tokenizer} tokens)"
    return TokenWindows(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, val_fraction=cfg.val_fraction,
                        seed=seed, vocab_size=vocab_size, what=what)


def local_rows(batch: Batch, dp_index: int, dp: int) -> Batch:
    """Pipeline `dp_index`'s rows of the global batch: the dp_index-th of dp equal slices (views).
    The global batch of step k stays a function of (seed, k), whatever the dp degree."""
    if dp == 1:
        return batch
    x, y = batch
    if x.shape[0] % dp:
        raise ValueError(f"data.batch_size={x.shape[0]} does not split over dp={dp} pipelines: "
                         f"set data.batch_size to a multiple of {dp}")
    per = x.shape[0] // dp
    return x[dp_index * per: (dp_index + 1) * per], y[dp_index * per: (dp_index + 1) * per]


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


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The token stream of `cfg` as a 1-D array: memory-mapped for data=tokens and for byte
    tokens of a text file (nothing read until a batch needs it), in memory otherwise."""
    if cfg.name == "tokens":
        return read_token_file(cfg.file)
    if cfg.tokenizer == "byte":
        if cfg.name == "text":
            return np.memmap(cfg.file, dtype=np.uint8, mode="r")
        return np.frombuffer(builtin_corpus(), dtype=np.uint8)
    text = cfg.file.read_text(encoding="utf-8", errors="replace") if cfg.name == "text" else builtin_corpus().decode()
    ids = gpt2_encoding(cfg.tokenizer_dir).encode_ordinary(text)
    return np.asarray(ids, dtype=np.uint16)  # GPT-2's 50,257 ids fit in 16 bits, as in nanoGPT's .bin


def read_token_file(path: Path) -> np.ndarray:
    """A token file (data=tokens, mode=eval) as a 1-D memory map: nanoGPT's .bin, raw uint16, no header."""
    return np.memmap(path, dtype=np.uint16, mode="r")


# GPT-2's pre-tokenisation pattern (openai/gpt-2 src/encoder.py; tiktoken's gpt2 encoding uses the same).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's encoder.json writes each byte as a printable character: the 188 printable
    Latin-1 bytes as themselves, the other 68 as chr(256 + n) in byte order (encoder.py,
    bytes_to_unicode). Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(BYTE_VOCAB) if b not in set(printable)]
    alphabet.update({chr(BYTE_VOCAB + n): b for n, b in enumerate(others)})
    return alphabet


def gpt2_encoding(tokenizer_dir: str | None = None) -> Any:
    """A tiktoken Encoding built from GPT-2's encoder.json found on this machine (see
    find_gpt2_encoder): the same ids as tiktoken.get_encoding("gpt2"), without its download."""
    import tiktoken  # optional: find_gpt2_encoder has checked it is installed

    path = find_gpt2_encoder(tokenizer_dir)
    alphabet = _gpt2_byte_alphabet()
    vocab = json.loads(path.read_text(encoding="utf-8"))
    eot = vocab.pop(GPT2_EOT, None)
    ranks = {bytes(alphabet[c] for c in token): rank for token, rank in vocab.items()}
    special = {GPT2_EOT: eot if eot is not None else len(ranks)}
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def _check_vocab(max_id: int, vocab_size: int, *, what: str, step: int | None = None) -> None:
    if max_id < vocab_size:
        return
    at = "" if step is None else f" (in the batch of step {step})"
    raise ValueError(
        f"{what} has token id {max_id}{at} but model.vocab_size={vocab_size}: set model.vocab_size >= {max_id + 1} "
        f"(byte tokens need {BYTE_VOCAB}, GPT-2's BPE 50257)"
    )
