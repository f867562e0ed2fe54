"""`pipetrain-prepare`: tokenize text, jsonl or parquet documents into llm.c-format token shards.

    pipetrain-prepare corpus.jsonl --out data/corpus --tokenizer hf --tokenizer-dir ~/models/Llama-3.2-1B
    pipetrain data=tokens data.path=data/corpus model=llama3.2-1b

Each document is preceded by the tokenizer's end-of-text id (as llm.c's dev/data/fineweb.py
writes them), so documents are separated by EOS and none runs into the next. Shards are llm.c's
headered .bin (pipetrain/config/shards.py): uint16 tokens when the vocabulary fits in 16 bits,
else uint32. The validation split is the first shard (`val_000000.bin`, llm.c's convention) or,
with --val-fraction F, every (1/F)-th document; training shards are `train_NNNNNN.bin`.
`data=tokens data.path=OUT` then reads the train shards and takes the val ones as validation.
Imports no torch.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from pipetrain.config.data import TOKENIZERS
from pipetrain.config.shards import LLMC_FORMATS, LLMC_HEADER_INTS, SHARD_SUFFIXES
from pipetrain.train.tokenizer import TextTokenizer, load_tokenizer

FORMATS = ("auto", "text", "jsonl", "parquet")
ENCODE_BATCH = 256  # documents per encode_batch call (the hf tokenizer encodes a batch in parallel)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


@dataclass
class ShardWriter:
    """Writes one split's token stream as llm.c shards of `shard_tokens` each (the last shorter)."""

    out: Path
    split: str  # train | val
    shard_tokens: int
    dtype: str  # '<u2' or '<u4'
    note: Callable[[str], None]
    written: list[tuple[Path, int]] = field(default_factory=list)
    _buf: list[np.ndarray] = field(default_factory=list)
    _held: int = 0

    def add(self, ids: np.ndarray) -> None:
        while len(ids):  # a document may straddle shards, as in llm.c's fineweb.py
            take = min(len(ids), self.shard_tokens - self._held)
            self._buf.append(ids[:take])
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
                f.write(part.astype(self.dtype).tobytes())
        self.written.append((path, self._held))
        self.note(f"wrote {path}: {self._held:,} tokens ({'uint16' if self.dtype == '<u2' else 'uint32'})")
        self._buf, self._held = [], 0


def input_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffixes = [s for s in path.suffixes if s != ".gz"]
    last = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}.get(last, "text")


def documents(path: Path, fmt: str, text_field: str) -> Iterator[str]:
    """The documents of one input file: a text file is one document; a jsonl line or a parquet
    row is one, its `text_field`."""
    kind = input_format(path, fmt)
    opener = gzip.open if path.suffix == ".gz" else open
    if kind == "text":
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            yield f.read()
    elif kind == "jsonl":
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {n} is not JSON ({e.msg}): give a jsonl file, one object a line")
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path} line {n} has no string field {text_field!r}: set --text-field to "
                                     "the field that holds the text")
                yield record[text_field]
    else:
        yield from _parquet_documents(path, text_field)


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    if importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"reading parquet ({path}) needs pyarrow: pip install pyarrow")
    import pyarrow.parquet as pq  # optional: only parquet input needs it

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}): "
                         "set --text-field")
    for batch in pf.iter_batches(columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def input_files(inputs: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec).expanduser()
        if p.is_dir():
            files += sorted(q for q in p.iterdir() if q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input {spec} does not exist")
    if not files:
        raise ValueError(f"no input files in {', '.join(inputs)}")
    return files


def prepare(inputs: Sequence[str], out: str, *, tokenizer: str = "byte", tokenizer_dir: Optional[str] = None,
            fmt: str = "auto", text_field: str = "text", shard_tokens: int = 100_000_000,
            val_fraction: Optional[float] = None, note: Callable[[str], None] = print) -> dict[str, list]:
    """Tokenize `inputs` into shards under `out`; returns {"train": [(path, tokens)], "val": [...]}.
    val_fraction None: the first shard is the validation split; else every (1/F)-th document."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1 (got {shard_tokens})")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1) (got {val_fraction}): e.g. 0.01 holds out 1%")
    out_dir = Path(out).expanduser()
    for above in (out_dir, *out_dir.parents):
        if above.exists() and not above.is_dir():
            where = "is a file" if above == out_dir else f"is inside {above}, which is a file"
            raise ValueError(f"--out {out} {where}: name a folder for the shards (empty or new)")
    files = input_files(inputs)
    tok = load_tokenizer(tokenizer, tokenizer_dir)
    if tok.eos_id is None:
        raise ValueError(f"tokenizer {tokenizer} ({tokenizer_dir}) has no end-of-text token: add eos_token to "
                         "its tokenizer_config.json")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(p.name for p in out_dir.iterdir() if p.suffix in SHARD_SUFFIXES)
    if old:
        raise ValueError(f"--out {out} already holds shards ({', '.join(old[:3])}, ...): choose an empty folder "
                         "or remove them (old shards would be read with the new)")
    dtype = "<u2" if tok.vocab_size <= 1 << 16 else "<u4"
    writers = {s: ShardWriter(out_dir, s, shard_tokens, dtype, note) for s in ("train", "val")}
    docs, text = _write_documents(files, tok, writers, fmt=fmt, text_field=text_field, val_fraction=val_fraction)
    for w in writers.values():
        w.flush()
    if not text:  # only the EOS ids between documents: say so, not "lower --shard-tokens"
        _remove_written(writers, out_dir if created else None)
        names = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise ValueError(f"the input is empty: {names} {'holds' if len(files) == 1 else 'hold'} no text "
                         f"({docs:,} document(s), none with a token): give files with text"
                         + (f" (or the --text-field that holds it, not {text_field!r})"
                            if any(input_format(f, fmt) != "text" for f in files) else ""))
    if val_fraction is None:  # llm.c's convention: shard 0 is validation
        first = writers["train"].written.pop(0) if writers["train"].written else None
        if first is None or not writers["train"].written:
            total = sum(n for _, n in writers["train"].written) + (first[1] if first else 0)
            raise ValueError(f"all {total:,} tokens fit in one shard, the validation split: lower --shard-tokens "
                             f"(e.g. {max(1, total // 10)}) or use --val-fraction")
        renamed = first[0].with_name("val_000000.bin")
        first[0].rename(renamed)
        writers["val"].written.append((renamed, first[1]))
        note(f"renamed {first[0].name} to {renamed.name}: the first shard is the validation split")
    written = {s: w.written for s, w in writers.items()}
    count = {s: sum(n for _, n in w) for s, w in written.items()}
    note(f"{docs:,} documents from {len(files)} file(s), tokenizer {tokenizer} (vocab {tok.vocab_size:,}, eos "
         f"{tok.eos_id}): train {count['train']:,} tokens in {len(written['train'])} shard(s), val "
         f"{count['val']:,} in {len(written['val'])}")
    note(f"train on it: pipetrain data=tokens data.path={out_dir} (model.vocab_size >= {tok.vocab_size})")
    return written


def _remove_written(writers: dict[str, ShardWriter], created: Optional[Path]) -> None:
    """Undo a refused run: the shards it wrote, and the --out folder when it made it."""
    for w in writers.values():
        for path, _ in w.written:
            path.unlink(missing_ok=True)
    if created is not None and not any(created.iterdir()):
        created.rmdir()


def _write_documents(files: list[Path], tok: TextTokenizer, writers: dict[str, ShardWriter], *, fmt: str,
                     text_field: str, val_fraction: Optional[float]) -> tuple[int, int]:
    """Encode every document (in batches), EOS first, into its split's writer; returns the count of
    documents and of their tokens (the EOS ids not counted)."""
    n = text = 0
    batch: list[str] = []

    def drain() -> None:
        nonlocal n, text
        for ids in tok.encode_batch(batch):
            text += len(ids)
            to_val = val_fraction is not None and math.floor((n + 1) * val_fraction) > math.floor(n * val_fraction)
            writers["val" if to_val else "train"].add(np.asarray([tok.eos_id, *ids], dtype=np.int64))
            n += 1
        batch.clear()

    for path in files:
        for doc in documents(path, fmt, text_field):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                drain()
    drain()
    return n, text


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="pipetrain-prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text, jsonl (.jsonl, .jsonl.gz) or parquet files, or folders of them")
    ap.add_argument("--out", required=True, help="folder for the shards (empty or new)")
    ap.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    ap.add_argument("--tokenizer-dir", help="gpt2: folder with encoder.json; hf: folder with tokenizer.json")
    ap.add_argument("--format", default="auto", choices=FORMATS,
                    help="auto: from the suffix (.jsonl, .parquet, else text)")
    ap.add_argument("--text-field", default="text", help="the jsonl field / parquet column holding the text")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (llm.c: 10^8)")
    ap.add_argument("--val-fraction", type=float,
                    help="every (1/F)-th document is validation (default: the first shard)")
    args = ap.parse_args(argv)
    try:
        prepare(args.inputs, args.out, tokenizer=args.tokenizer, tokenizer_dir=args.tokenizer_dir, fmt=args.format,
                text_field=args.text_field, shard_tokens=args.shard_tokens, val_fraction=args.val_fraction)
    except USER_ERRORS as e:
        print(f"pipetrain-prepare: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
