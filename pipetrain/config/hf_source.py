"""One Hugging Face `datasets` source: what `data.path` names, opened the same way by the config
check, the loader (train/hf_data.py) and pipetrain-prepare.

`data.path` may be
- a `save_to_disk` folder (state.json or dataset_dict.json): `load_from_disk`, memory-mapped;
- a hub-layout folder (parquet under data/, `train-*.parquet`, a README.md with configs):
  `load_dataset(folder)`, which reads the layout as the hub would;
- a local file or glob of .jsonl/.json/.parquet/.arrow/.csv/.txt (optionally .gz): `load_dataset`
  with the builder its suffix names (txt: a line a row, as `datasets`' text builder);
- a hub name (`owner/name`) on a machine with network.

Imports neither torch nor `datasets` at module level: `datasets` (~1 s) is imported by the
functions that open a source, so `pipetrain --help` and runs on other data never load it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

# suffix (without .gz) -> `datasets` builder
BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".arrow": "arrow",
            ".csv": "csv", ".txt": "text"}
SAVED = ("state.json", "dataset_info.json", "dataset_dict.json")  # what save_to_disk writes
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class HFSource:
    """Where `spec` (data.path) points, told apart before anything is read."""

    spec: str
    kind: str  # disk (save_to_disk; one Dataset is data.split whatever its name) | folder (hub layout) | files | hub
    files: tuple[Path, ...] = ()  # kind=files: the files, sorted; kind=disk/folder: every file under it
    builder_name: str = ""  # kind=files: the `datasets` builder when not the one the suffix names
    knob: str = "data.path"  # what errors call it (pipetrain-prepare: "input")

    @property
    def builder(self) -> str:
        return self.builder_name or BUILDERS[suffix_of(self.files[0])]

    def fingerprint(self) -> str:
        """What the source holds, for cache keys: every file's path, size and mtime (a rewritten file
        changes it); a hub name is keyed by the name (the loader adds the dataset's own fingerprint)."""
        h = hashlib.sha256(f"{self.kind}\0{self.spec}".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]

    def open(self, split: str, *, streaming: bool = False) -> Any:
        """The `datasets` Dataset (or IterableDataset) of `split`; one-line errors naming the path and split."""
        import datasets

        datasets.disable_progress_bars()  # every rank would draw its own bars over the run's console
        try:
            if self.kind == "disk":
                try:
                    ds = datasets.load_from_disk(self.spec)
                except IndexError:  # datasets 5.2 cannot concatenate the zero tables of an empty save
                    raise ValueError(f"{self.knob}={self.spec} is empty (a saved dataset with no rows): give a "
                                     "source with documents") from None
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise ValueError(f"{self.knob}={self.spec} has no split {split!r} (splits: {', '.join(ds)}): "
                                         "set data.split (or data.val_split) to one of them")
                    ds = ds[split]
                return ds.to_iterable_dataset() if streaming else ds
            if self.kind == "files":
                return datasets.load_dataset(self.builder, data_files={split: [str(f) for f in self.files]},
                                             split=split, streaming=streaming)
            return datasets.load_dataset(self.spec, split=split, streaming=streaming)
        except ValueError as e:
            if "split" in str(e).lower() and f"{self.knob}=" not in str(e):
                raise ValueError(f"{self.knob}={self.spec} has no split {split!r} ({_first_line(e)}): set data.split "
                                 "(or data.val_split) to one of its splits") from None
            raise
        except OSError as e:  # datasets' DatasetNotFoundError and EmptyDatasetError are FileNotFoundErrors
            raise ValueError(f"{self.knob}={self.spec}: `datasets` cannot read it ({_first_line(e)})") from None


def find_source(spec: str, *, knob: str = "data.path") -> HFSource:
    """The source `spec` names, or a one-line error saying what `knob` must name."""
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts))
        if any((path / name).is_file() for name in SAVED):
            return HFSource(spec, "disk", files, knob=knob)
        if not any(suffix_of(f) in BUILDERS for f in files):
            raise ValueError(f"{knob}={spec} is a folder with no data files (none of {', '.join(BUILDERS)}) and no "
                             "save_to_disk files: point it at a save_to_disk folder, a hub-layout folder or a file")
        return HFSource(spec, "folder", files, knob=knob)
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec))) if glob.has_magic(spec) else (
        [path] if path.is_file() else [])
    if matches:
        kinds = {suffix_of(f) for f in matches}
        unknown = sorted(k for k in kinds if k not in BUILDERS)
        if unknown:
            raise ValueError(f"{knob}={spec}: `datasets` reads {', '.join(BUILDERS)} files, not "
                             f"{unknown[0] or 'files without a suffix'} ({matches[0]}): convert it, or use data=text")
        if len({BUILDERS[k] for k in kinds}) > 1:
            raise ValueError(f"{knob}={spec} matches files of several formats ({', '.join(sorted(kinds))}): "
                             "give files of one format")
        return HFSource(spec, "files", tuple(matches), knob=knob)
    if glob.has_magic(spec):
        raise FileNotFoundError(f"{knob}={spec} matches no file")
    if not path.is_absolute() and HUB_NAME.fullmatch(spec) and not spec.startswith((".", "~")) \
            and suffix_of(path) not in BUILDERS:
        return HFSource(spec, "hub", knob=knob)  # read at load time, on a machine with network
    where = "" if path.is_absolute() else f" (relative to {os.getcwd()})"
    raise FileNotFoundError(f"{knob}={spec} does not exist{where}: give a file, a glob, a save_to_disk or "
                            "hub-layout folder, or a hub name (owner/name)")


def check_text_field(ds: Any, *, spec: str, split: str, text_field: str) -> None:
    """The first row of `ds` holds a string `text_field`; one line naming the path and the fields
    present otherwise, or saying the split is empty."""
    first = next(iter(ds), None) if not hasattr(ds, "__len__") or len(ds) else None
    if first is None:
        raise ValueError(f"data.path={spec} split {split!r} is empty (no rows): give a source with documents")
    if not isinstance(first.get(text_field), str):
        has = "no field" if text_field not in first else f"a {type(first[text_field]).__name__}, not a string, in"
        raise ValueError(f"data.path={spec} row 0 of split {split!r} has {has} {text_field!r} (fields: "
                         f"{', '.join(first)}): set data.text_field to the field that holds the text")


def texts(ds: Any, *, where: str, text_field: str, batch: int = 1000) -> Iterator[list[Optional[str]]]:
    """The text of every row, in order, `batch` rows at a time (one Arrow column read per batch);
    a row whose field is not a string is one line naming the row. `where`: the source, as errors name it."""
    if text_field not in (ds.column_names or []):
        raise ValueError(f"{where} has no field {text_field!r} (fields: {', '.join(ds.column_names or [])}): "
                         "set data.text_field to the field that holds the text")
    row = 0
    for part in ds.select_columns([text_field]).iter(batch_size=batch):
        column = part[text_field]
        for i, t in enumerate(column):
            if t is not None and not isinstance(t, str):
                raise ValueError(f"{where} row {row + i} has a {type(t).__name__} in {text_field!r}, not "
                                 "a string: set data.text_field to the field that holds the text")
        row += len(column)
        yield column


def suffix_of(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    return suffixes[-1] if suffixes else ""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
