"""data=datasets' sources: `data.path` (one source) or `data.sources` (a weighted mixture), and
whether they are streamed (`data.streaming`). Checked before any process starts.

Pure Python (no torch, no numpy, no `datasets` at import): config/hf_source.py opens a source only
inside the check functions.

A mixture entry is `{path: P, weight: W}`, optionally `split`, `text_field` (data.split /
data.text_field when unset) and `name` (what `data/tokens/<name>` calls it; by default the file's
stem, a glob's folder, a folder's or a hub dataset's name). The weights need not sum to 1: source
i's share of the rows (and with packing, of the tokens) is weight_i / sum (train/hf_mix.py).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

class DataConfig(Protocol):
    """What this file reads of config/data.py's DataConfig (which imports this file: no import back)."""

    name: str
    path: Optional[str]
    sources: list[SourceConfig]
    split: str
    text_field: str
    val_split: Optional[str]
    streaming: Optional[bool]

# data.streaming=null streams a source whose files hold more than this (or a hub name): 1 GiB of text
# is ~250M tokens, minutes of one core to tokenize up front and as much again on disk for the cache;
# below it the cached stream is cheap and gives shuffled rows without any state to save.
STREAM_BYTES = 1 << 30
NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a metric key's last part: no '/', no spaces


@dataclass
class SourceConfig:
    """One entry of data.sources."""

    path: str = ""  # a file, glob, save_to_disk or hub-layout folder, or a hub name (as data.path)
    weight: float = 1.0  # its share of the rows is weight / the sum of the weights
    split: Optional[str] = None  # null: data.split
    text_field: Optional[str] = None  # null: data.text_field
    name: Optional[str] = None  # null: from the path (the file's stem, the folder's or dataset's name)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("data.sources: every entry needs a path: {path: FILE, weight: 0.5}")
        if not self.weight > 0:
            raise ValueError(f"data.sources: {self.path} has weight {self.weight}: every weight must be > 0 (drop "
                             "the source instead of weighting it 0)")
        if self.name is not None and not NAME.fullmatch(self.name):
            raise ValueError(f"data.sources: name {self.name!r} of {self.path} names a metric (data/tokens/<name>): "
                             "use letters, digits, '_', '.' or '-'")

    @property
    def label(self) -> str:
        """What metrics and errors call it: name, else derived from the path."""
        return self.name or default_name(self.path)


def default_name(spec: str) -> str:
    """web.jsonl -> web; /data/c4/*.jsonl -> c4; /data/corpus (a folder) -> corpus; owner/name -> name."""
    path = Path(os.path.expanduser(spec))
    if glob.has_magic(spec):  # the folder of its fixed prefix: /data/c4/train-*.jsonl -> c4
        stem = Path(os.path.dirname(re.split(r"[*?\[]", os.path.expanduser(spec))[0])).name
    elif path.is_dir() or not path.suffix:
        stem = path.name
    else:
        stem = path.name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source"


def source_list(cfg: DataConfig) -> list[SourceConfig]:
    """data=datasets' sources with split / text_field filled in: data.sources, or data.path as one."""
    entries = cfg.sources or [SourceConfig(path=cfg.path or "")]
    return [SourceConfig(path=s.path, weight=s.weight, split=s.split or cfg.split,
                         text_field=s.text_field or cfg.text_field, name=s.label) for s in entries]


def as_sources(raw: Any) -> list[SourceConfig]:
    """data.sources as SourceConfigs (Hydra gives them; a test or script may give dicts)."""
    out = []
    for entry in raw or []:
        if isinstance(entry, SourceConfig):
            out.append(entry)
        elif isinstance(entry, dict):
            unknown = sorted(set(entry) - {"path", "weight", "split", "text_field", "name"})
            if unknown:
                raise ValueError(f"data.sources: unknown key {unknown[0]!r} in {entry}: an entry has path, weight, "
                                 "split, text_field, name")
            out.append(SourceConfig(**entry))
        else:
            raise TypeError(f"data.sources: each entry is {{path: ..., weight: ...}} (got {entry!r})")
    return out


def check_sources(cfg: DataConfig) -> None:
    """data=datasets: data.path or data.sources (not both), names that differ, and every source readable
    (check_hf_source)."""
    if cfg.path and cfg.sources:
        raise ValueError("data.path and data.sources are exclusive: give one source as data.path, or a mixture as "
                         "data.sources=[{path: A, weight: 0.7}, {path: B, weight: 0.3}] and data.path=null")
    if not cfg.path and not cfg.sources:
        raise ValueError(f"data={cfg.name} needs a source: add data.path=FILE, GLOB, FOLDER (save_to_disk or hub "
                         "layout) or a hub name (owner/name), or a mixture data.sources=[{path: ..., weight: ...}]")
    sources = source_list(cfg)
    seen: dict[str, str] = {}
    for s in sources:
        if s.label in seen:
            raise ValueError(f"data.sources: {seen[s.label]} and {s.path} are both named {s.label!r} (data/tokens/"
                             f"{s.label}): give each a name: {{path: ..., weight: ..., name: ...}}")
        seen[s.label] = s.path
    for s in sources:
        check_hf_source(s, val_split=cfg.val_split, chat=cfg.name == "sft")


def check_hf_source(source: SourceConfig, *, val_split: Optional[str], chat: bool = False) -> None:
    """Before any process starts: the source's path is one `datasets` reads, and (when it is on this
    machine) the first row of its split (and data.val_split) holds the string text_field. A hub name is
    read by the ranks, on a machine with network."""
    from pipetrain.config.hf_source import check_text_field, find_source  # imports datasets only when opening

    found = find_source(source.path)
    if found.kind == "hub":
        return
    saved_dict = Path(os.path.expanduser(source.path), "dataset_dict.json").is_file()
    one_split = found.kind == "files" or (found.kind == "disk" and not saved_dict)
    if val_split and one_split:
        raise ValueError(f"data.path={source.path} holds one split (a file, or one saved Dataset), so it has no "
                         f"data.val_split={val_split}: drop it (data.val_fraction holds out the last documents)")
    assert source.split and source.text_field, "source_list fills them in"
    for split in (source.split, *([val_split] if val_split else [])):
        # streaming reads the first row, not the whole source; a saved folder is memory-mapped anyway
        ds = found.open(split, streaming=found.kind != "disk")
        if chat:  # data=sft: `messages`, or `prompt` and `completion` (config/sft.py)
            from pipetrain.config.sft import check_chat_row

            check_chat_row(ds, spec=source.path, split=split)
        else:
            check_text_field(ds, spec=source.path, split=split, text_field=source.text_field)


def streams(cfg: DataConfig) -> bool:
    """data.streaming, or where it is null: whether any source is a hub name or holds > STREAM_BYTES.
    data=sft never streams of itself (its chats are rendered and cached once; config/sft.py refuses true)."""
    if cfg.streaming is not None:
        return cfg.streaming
    if cfg.name == "sft":
        return False
    from pipetrain.config.hf_source import find_source

    for s in source_list(cfg):
        found = find_source(s.path)
        if found.kind == "hub" or sum(f.stat().st_size for f in found.files) > STREAM_BYTES:
            return True
    return False
