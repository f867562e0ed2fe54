"""`pipetrain-prepare`: tokenize documents (text, jsonl, parquet, arrow, csv; save_to_disk and hub-layout
folders through Hugging Face `datasets`: prepare_in.py) into llm.c-format token shards.

    pipetrain-prepare corpus.jsonl --out data/corpus --tokenizer hf --tokenizer-dir ~/models/Llama-3.2-1B
    pipetrain data=tokens data.path=data/corpus model=llama3.2-1b

Each document is preceded by the tokenizer's end-of-text id (as llm.c's dev/data/fineweb.py
writes them), so documents are separated by EOS and none runs into the next. Shards are llm.c's
headered .bin (pipetrain/config/shards.py): uint16 tokens when the vocabulary fits in 16 bits,
else uint32; `train_NNNNNN.bin` and `val_NNNNNN.bin`, which `data=tokens data.path=OUT` reads as
the training stream and the validation one. Beside them, `tokenized_by.json` records the tokenizer
(its name and the sha256 of its file, config/token_origin.py): a run with another tokenizer refuses them.

The validation split is --val-fraction of the tokens (0.5%), whole documents spread over the
corpus: a document goes to it while that keeps it within that fraction of the tokens so far.
When the documents give it too little (under --val-min-tokens, or under half its share: a few
long documents), the end of the training stream tops it up, cut at a document's start when one
lies within reach; a corpus too small to hold out --val-min-tokens and train on as many is refused.
Everything is written into a hidden sibling of --out first and renamed into place when the run
has succeeded (pipetrain/prepare_out.py). Imports no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from pipetrain.config.data import TOKENIZERS
from pipetrain.config.shards import LLMC_FORMATS, LLMC_HEADER_BYTES, LLMC_HEADER_INTS
from pipetrain.config.token_origin import write_record
from pipetrain.prepare_in import FORMATS, documents, input_files, input_format
from pipetrain.prepare_out import PartialOut, check_out
from pipetrain.train.tokenizer import TextTokenizer, load_tokenizer

ENCODE_BATCH = 256  # documents per encode_batch call (the hf tokenizer encodes a batch in parallel)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)
# 0.5% held out for the validation loss: llm.c's fineweb10B holds out 1 of 100 shards (1%); half
# that still gives 50M tokens on 10B, far more windows than an eval reads.
VAL_FRACTION = 0.005
# The least validation split: one window of data.seq_len=1024 (GPT-2's context) and its shifted
# target. Longer sequences need more: raise --val-min-tokens to data.seq_len + 1.
VAL_MIN_TOKENS = 1025
# Optional packages, and the pip line that brings each (pyproject has no extra for them).
PIP = {"pyarrow": "pip install pyarrow", "tiktoken": "pip install tiktoken"}


@dataclass
class ShardWriter:
    """Writes one split's token stream as llm.c shards of `shard_tokens` each (the last shorter)."""

    out: Path
    split: str  # train | val
    shard_tokens: int
    dtype: str  # '<u2' or '<u4'
    note: Callable[[str], None]
    written: list[tuple[Path, int]] = field(default_factory=list)
    tokens: int = 0  # every token added and not taken back, flushed or held
    _buf: list[np.ndarray] = field(default_factory=list)
    _held: int = 0

    def add(self, ids: np.ndarray) -> None:
        self.tokens += len(ids)
        self._push(ids)

    def _push(self, ids: np.ndarray) -> None:
        while len(ids):  # a document may straddle shards, as in llm.c's fineweb.py
            take = min(len(ids), self.shard_tokens - self._held)
            self._buf.append(ids[:take].astype(self.dtype))  # held in the shard's dtype: 2-4x less than int64
            self._held += take
            ids = ids[take:]
            if self._held == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self._held:
            return
        path = self.out / f"{self.split}_{len(self.written):06d}.bin"
        magic, version = next(k for k, v in LLMC_FORMATS.items() if v == self.dtype)
        header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        header[:3] = magic, version, self._held
        with open(path, "wb") as f:
            f.write(header.tobytes())
            for part in self._buf:
                f.write(part.tobytes())
        self.written.append((path, self._held))
        self.note(f"wrote {path}: {self._held:,} tokens ({'uint16' if self.dtype == '<u2' else 'uint32'})")
        self._buf, self._held = [], 0

    def take_tail(self, n: int, *, most: int, start_id: int) -> np.ndarray:
        """Take back the last tokens added and return them: at least n and at most `most`, starting
        at a `start_id` (a document's first token) when one lies in that range, else exactly n.
        Flushed shards are read back (and removed) as far as needed; the rest is re-added."""
        while self._held < most and self.written:
            path, count = self.written.pop()
            self._buf.insert(0, np.fromfile(path, dtype=self.dtype, offset=LLMC_HEADER_BYTES))
            self._held += count
            path.unlink()
        ids = np.concatenate(self._buf) if self._buf else np.zeros(0, dtype=self.dtype)
        lo, cut = max(0, len(ids) - most), len(ids) - n
        starts = np.flatnonzero(ids[lo:cut + 1] == start_id)
        cut = lo + int(starts[-1]) if starts.size else cut
        self._buf, self._held = [], 0
        self._push(ids[:cut])
        self.tokens -= len(ids) - cut
        return ids[cut:]


def prepare(inputs: Sequence[str], out: str, *, tokenizer: str = "byte", tokenizer_dir: Optional[str] = None,
            fmt: str = "auto", text_field: str = "text", split: str = "train", shard_tokens: int = 100_000_000,
            val_fraction: float = VAL_FRACTION, val_min_tokens: int = VAL_MIN_TOKENS, overwrite: bool = False,
            note: Callable[[str], None] = print) -> dict[str, list]:
    """Tokenize `inputs` into shards under `out`, written all at once (prepare_out.PartialOut);
    returns {"train": [(path, tokens)], "val": [...]}."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1 (got {shard_tokens})")
    if not 0 < val_fraction <= 0.5:
        raise ValueError(f"--val-fraction must be in (0, 0.5] (got {val_fraction}): e.g. 0.01 holds out 1%")
    if val_min_tokens < 1:
        raise ValueError(f"--val-min-tokens must be >= 1 (got {val_min_tokens}): validation needs one window of "
                         "data.seq_len + 1 tokens")
    files = input_files(inputs)
    reads = [("an input", f) for f in files] + ([("--tokenizer-dir", Path(tokenizer_dir).expanduser())]
                                                if tokenizer_dir else [])
    out_dir = check_out(out, overwrite=overwrite, reads=reads)
    check_packages(files, fmt, tokenizer)
    tok = load_tokenizer(tokenizer, tokenizer_dir)
    if tok.eos_id is None:
        raise ValueError(f"tokenizer {tokenizer} ({tokenizer_dir}) has no end-of-text token: add eos_token to "
                         "its tokenizer_config.json")
    dtype = "<u2" if tok.vocab_size <= 1 << 16 else "<u4"
    with PartialOut(out_dir, note) as partial:
        writers = {s: ShardWriter(partial.path, s, shard_tokens, dtype, note) for s in ("train", "val")}
        docs, text = _write_documents(files, tok, writers, fmt=fmt, text_field=text_field, split=split,
                                      val_fraction=val_fraction)
        if not text:  # only the EOS ids between documents: say so, not "lower --val-min-tokens"
            names = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
            raise ValueError(f"the input is empty: {names} {'holds' if len(files) == 1 else 'hold'} no text "
                             f"({docs:,} document(s), none with more than whitespace): give files with text"
                             + (f" (or the --text-field that holds it, not {text_field!r})"
                                if any(input_format(f, fmt) != "text" for f in files) else ""))
        _top_up_val(writers, val_fraction=val_fraction, val_min_tokens=val_min_tokens, start_id=tok.eos_id, note=note)
        for w in writers.values():
            w.flush()
        write_record(partial.path, tokenizer, tokenizer_dir, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
        partial.install()
    written = {s: [(out_dir / path.name, n) for path, n in w.written] for s, w in writers.items()}
    count = {s: w.tokens for s, w in writers.items()}
    note(f"{docs:,} documents from {len(files)} file(s), tokenizer {tokenizer} (vocab {tok.vocab_size:,}, eos "
         f"{tok.eos_id}): train {count['train']:,} tokens in {len(written['train'])} shard(s), val "
         f"{count['val']:,} in {len(written['val'])}, in {out_dir}")
    note(f"train on it: pipetrain data=tokens data.path={out_dir} (model.vocab_size >= {tok.vocab_size}, "
         f"data.seq_len <= {min(count.values()) - 1:,})")
    return written


def check_packages(files: Sequence[Path], fmt: str, tokenizer: str) -> None:
    """A one-line error naming the pip line when an optional package the run needs is missing:
    before any file is read."""
    parquet = [f for f in files if input_format(f, fmt) == "parquet"]
    if parquet and importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"reading parquet ({parquet[0]}) needs the pyarrow package: {PIP['pyarrow']}")
    if tokenizer == "gpt2" and importlib.util.find_spec("tiktoken") is None:
        raise ValueError(f"--tokenizer gpt2 needs the tiktoken package: {PIP['tiktoken']} (or use --tokenizer hf "
                         "with a tokenizer.json, or --tokenizer byte)")


def _top_up_val(writers: dict[str, ShardWriter], *, val_fraction: float, val_min_tokens: int, start_id: int,
                note: Callable[[str], None]) -> None:
    """When the documents gave validation too little (under val_min_tokens, or under half its
    share: a few long documents), move the end of the training stream to it, up to the larger of
    the two, cut at a document's start when one lies within reach. A one-line error when the
    corpus cannot hold out val_min_tokens and train on at least as many."""
    train, val = writers["train"], writers["val"]
    total = train.tokens + val.tokens
    if 2 * val_min_tokens > total:
        raise ValueError(f"the input holds {total:,} tokens, too few to hold out --val-min-tokens={val_min_tokens:,} "
                         f"for validation and train on at least as many: lower --val-min-tokens (at most "
                         f"{total // 2:,}; validation needs one window of data.seq_len + 1 tokens) or give more text")
    if val.tokens >= val_min_tokens and 2 * val.tokens >= val_fraction * total:
        return
    need = min(max(val_min_tokens, math.ceil(val_fraction * total)), total // 2) - val.tokens
    tail = train.take_tail(need, most=min(2 * need, (train.tokens - val.tokens) // 2), start_id=start_id)
    val.add(tail)
    note(f"validation: {val.tokens - len(tail):,} tokens of whole documents and {len(tail):,} from the end of the "
         f"stream (--val-min-tokens {val_min_tokens:,}, --val-fraction {val_fraction})")


def _write_documents(files: list[Path], tok: TextTokenizer, writers: dict[str, ShardWriter], *, fmt: str,
                     text_field: str, split: str, val_fraction: float) -> tuple[int, int]:
    """Encode every document (in batches), EOS first, into its split's writer; returns the count of
    documents and of the tokens of those with text (the EOS ids and whitespace-only documents not
    counted: a file of blank lines is empty, not "351 tokens"). A document goes to validation while
    that keeps it within val_fraction of the tokens so far: with equal documents, every (1/F)-th."""
    n = text = 0
    batch: list[str] = []

    def drain() -> None:
        nonlocal n, text
        for doc_text, ids in zip(batch, tok.encode_batch(batch)):
            text += len(ids) if doc_text.strip() else 0
            doc = np.asarray([tok.eos_id, *ids], dtype=np.int64)
            seen = writers["train"].tokens + writers["val"].tokens + len(doc)
            writers["val" if writers["val"].tokens + len(doc) <= val_fraction * seen else "train"].add(doc)
            n += 1
        batch.clear()

    for path in files:
        for doc in documents(path, fmt, text_field, split):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                drain()
    drain()
    return n, text


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="pipetrain-prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text, jsonl (.jsonl, .jsonl.gz), parquet, arrow or csv files, "
                    "folders of them, or a save_to_disk or hub-layout folder (read through Hugging Face datasets)")
    ap.add_argument("--out", required=True, help="folder for the shards (new or empty)")
    ap.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    ap.add_argument("--tokenizer-dir", help="gpt2: folder with encoder.json; hf: folder with tokenizer.json")
    ap.add_argument("--format", default="auto", choices=FORMATS,
                    help="auto: from the suffix (.jsonl, .parquet, .arrow, .csv, else text)")
    ap.add_argument("--text-field", default="text", help="the field (jsonl) or column holding the text")
    ap.add_argument("--split", default="train", help="the split of a save_to_disk or hub-layout folder")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (llm.c: 10^8)")
    ap.add_argument("--val-fraction", type=float, default=VAL_FRACTION,
                    help="the share of the tokens held out for validation, as whole documents (0.005: 0.5%%)")
    ap.add_argument("--val-min-tokens", type=int, default=VAL_MIN_TOKENS,
                    help="the least validation split, topped up from the end of the stream: at least data.seq_len + 1")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out and everything in it (when the run has succeeded)")
    args = ap.parse_args(argv)
    try:
        prepare(args.inputs, args.out, tokenizer=args.tokenizer, tokenizer_dir=args.tokenizer_dir, fmt=args.format,
                text_field=args.text_field, split=args.split, shard_tokens=args.shard_tokens,
                val_fraction=args.val_fraction, val_min_tokens=args.val_min_tokens, overwrite=args.overwrite)
    except USER_ERRORS as e:
        print(f"pipetrain-prepare: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
