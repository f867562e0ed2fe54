"""Which tokenizer made a folder of token shards: the record pipetrain-prepare writes beside them
(`tokenized_by.json`), so that a run can tell token files made by another tokenizer than its own.

A tokenizer is known by its name and the sha256 of the file that defines it (hf: tokenizer.json,
gpt2: encoder.json; byte: none), so a folder moved or copied elsewhere still matches. Pure Python:
json and hashlib only.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from pipetrain.config.data import find_gpt2_encoder, find_hf_tokenizer

RECORD = "tokenized_by.json"  # beside the shards, in --out


def tokenizer_file(name: str, tokenizer_dir: str | None) -> Path | None:
    """The file that defines a tokenizer (None for byte, which needs none)."""
    if name == "hf":
        return find_hf_tokenizer(tokenizer_dir)
    if name == "gpt2":
        return find_gpt2_encoder(tokenizer_dir)
    return None


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, computed once per (path, size, mtime): the planner checks many copies of a config."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def origin(name: str, tokenizer_dir: str | None) -> dict[str, Any]:
    """{"tokenizer": name, "file": its defining file or None, "sha256": that file's or None}."""
    path = tokenizer_file(name, tokenizer_dir)
    if path is None:
        return {"tokenizer": name, "file": None, "sha256": None}
    st = path.resolve().stat()
    return {"tokenizer": name, "file": str(path.resolve()), "sha256": _sha256(str(path.resolve()), st.st_size,
                                                                              st.st_mtime_ns)}


def write_record(folder: Path, name: str, tokenizer_dir: str | None, *, vocab_size: int, eos_id: int) -> Path:
    """pipetrain-prepare: the record of the tokenizer that made the shards in `folder`."""
    path = folder / RECORD
    path.write_text(json.dumps({**origin(name, tokenizer_dir), "vocab_size": vocab_size, "eos_id": eos_id},
                               indent=2) + "\n", encoding="utf-8")
    return path
