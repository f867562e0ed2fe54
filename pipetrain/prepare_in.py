"""What `pipetrain-prepare` reads: its inputs as files and datasets, and the documents of each.

An input is a file (text, jsonl, parquet: read here, streamed; arrow, csv: through Hugging Face
`datasets`), a folder of such files, or a `datasets` folder read as one dataset (its --split):
a `save_to_disk` folder (state.json / dataset_dict.json), or a hub-layout folder (a README.md, or
data files below a subfolder, as parquet under data/). A file read as text must be text: a NUL
byte or bytes that are not UTF-8 at its start refuse it in one line (an .arrow file renamed, or
given with --format text, would otherwise "succeed" with garbage tokens). Imports no torch, and
`datasets` only for the inputs that need it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator, Sequence

from pipetrain.config.hf_source import BUILDERS, SAVED, HFSource, find_source, suffix_of, texts

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow", "csv")
SNIFF_BYTES = 1 << 16  # the start of a text input checked for binary content


def input_format(path: Path, fmt: str) -> str:
    """The reader of one input: `dataset` for a datasets folder, else --format or the file's suffix."""
    if path.is_dir():
        return "dataset"
    if fmt != "auto":
        return fmt
    suffixes = [s for s in path.suffixes if s != ".gz"]
    last = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow",
            ".csv": "csv"}.get(last, "text")


def is_dataset_folder(folder: Path) -> bool:
    """A folder `datasets` reads as one dataset: save_to_disk's files, a README.md (a hub dataset card),
    or data files below a subfolder (hub layout: data/train-00000-of-00001.parquet)."""
    if any((folder / name).is_file() for name in (*SAVED, "README.md")):
        return True
    return any(p.is_file() and p.parent != folder and suffix_of(p) in BUILDERS for p in folder.rglob("*"))


def input_files(inputs: Sequence[str]) -> list[Path]:
    """The inputs in order: a datasets folder as itself, a plain folder as its files (sorted)."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec).expanduser()
        if p.is_dir():
            files += [p] if is_dataset_folder(p) else sorted(q for q in p.iterdir() if q.is_file())
        elif p.exists():  # a file, or a pipe: zcat corpus.jsonl.gz | pipetrain-prepare /dev/stdin --format jsonl
            files.append(p)
        else:
            raise FileNotFoundError(f"input {spec} does not exist")
    if not files:
        raise ValueError(f"no input files in {', '.join(inputs)}")
    return files


def documents(path: Path, fmt: str, text_field: str, split: str = "train") -> Iterator[str]:
    """The documents of one input: a text file is one document; a jsonl line, a parquet, arrow or
    csv row, or a dataset's row is one, its `text_field`."""
    kind = input_format(path, fmt)
    opener = gzip.open if path.suffix == ".gz" else open
    if kind == "text":
        check_text(path)
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            yield f.read()
    elif kind == "jsonl":
        yield from _jsonl_documents(path, text_field)
    elif kind == "parquet":
        yield from _parquet_documents(path, text_field)
    else:  # arrow, csv, a datasets folder
        # arrow and csv: `datasets`' builders of those names, whatever the suffix (--format)
        source = find_source(str(path), knob="input") if kind == "dataset" else HFSource(
            str(path), "files", (path,), builder_name=kind, knob="input")
        for column in texts(source.open(split), where=str(path), text_field=text_field):
            yield from (t for t in column if t is not None)


def check_text(path: Path) -> None:
    """A one-line error when the start of a text input is binary: a NUL byte, or not UTF-8."""
    if not path.is_file():
        return  # a pipe: nothing to peek at without consuming it
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    nul = head.find(b"\0")
    why = f"a NUL byte at offset {nul}" if nul >= 0 else ""
    if not why:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 3:  # not a character cut by SNIFF_BYTES
                why = f"bytes that are not UTF-8 at offset {e.start}"
    if why:
        raise ValueError(f"{path} is not text ({why}): give text, jsonl, parquet, arrow or csv files, a "
                         "save_to_disk or hub-layout folder, or the right --format")


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path} line {n} is not JSON ({e.msg}): give a jsonl file, one object a line") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path} line {n} has no string field {text_field!r}: set --text-field to "
                                 "the field that holds the text")
            yield record[text_field]


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # optional: only parquet input needs it (check_packages said it is there)

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}): "
                         "set --text-field")
    for batch in pf.iter_batches(columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)
