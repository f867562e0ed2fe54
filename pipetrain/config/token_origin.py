"""Which tokenizer made a folder of token shards: the record pipetrain-prepare writes beside them
(`tokenized_by.json`), and the check that refuses, before any process starts, token files whose
record names another tokenizer than the run's (a fine-tune's ids must be its folder's tokenizer's).

A tokenizer is known by its name and the sha256 of the file that defines it (hf: tokenizer.json,
gpt2: encoder.json; byte: none), so a folder moved or copied elsewhere still matches. Shards with
no record (nanoGPT's, llm.c's, a hand-made .npy) are not refused: the run's header says they were
not checked. Pure Python: json and hashlib only.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from pipetrain.config.data import DataConfig, find_gpt2_encoder, find_hf_tokenizer

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


def _text(o: dict[str, Any]) -> str:
    """A tokenizer in a few words: `hf (/models/x/tokenizer.json, sha256 1a2b3c4d)`, `byte`."""
    return o["tokenizer"] if not o.get("file") else f"{o['tokenizer']} ({o['file']}, sha256 {str(o['sha256'])[:8]})"


def check_origin(data: DataConfig) -> list[Path]:
    """data=tokens with a tokenizer set (data.tokenizer, or model.pretrained's): a one-line ValueError when
    a shard folder's record names another tokenizer; returns the folders that hold no record."""
    if data.name != "tokens" or data.tokenizer is None:
        return []
    train, val = data.token_shards()
    train_folders = {s.path.parent for s in train}
    folders = list(dict.fromkeys(s.path.parent for s in [*train, *val]))
    mine = origin(data.tokenizer, data.tokenizer_dir)
    unrecorded = []
    for folder in folders:
        path = folder / RECORD
        if not path.is_file():
            unrecorded.append(folder)
            continue
        try:
            made = json.loads(path.read_text(encoding="utf-8"))
            key = (made["tokenizer"], made.get("sha256"))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} is not a record pipetrain-prepare wrote (a JSON object with `tokenizer` and "
                             f"`sha256`): remove it or run pipetrain-prepare again") from None
        if key != (mine["tokenizer"], mine["sha256"]):
            dir_arg = f" --tokenizer-dir {data.tokenizer_dir}" if data.tokenizer_dir else ""
            knob = f"data.path={data.path}" if folder in train_folders else f"data.val_path={data.val_path}"
            raise ValueError(
                f"{knob}: {folder}'s token ids were made by tokenizer {_text(made)} ({RECORD}), not by this run's "
                f"data.tokenizer={_text(mine)}: tokenize the text again with pipetrain-prepare "
                f"--tokenizer {data.tokenizer}{dir_arg}, or set data.tokenizer and data.tokenizer_dir to the "
                f"tokenizer that made them")
    return unrecorded
