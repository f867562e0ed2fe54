"""Token files on disk, known from their headers alone: which files `data.path` names, what
format each is in, where its tokens start and how many it holds.

Pure Python (no numpy): the data schema checks every shard with it before any process starts,
and pipetrain/train/data.py memory-maps exactly what it describes. Formats:

- nanoGPT's `.bin`: raw uint16 token ids, no header (nanoGPT's data/*/prepare.py).
- llm.c's `.bin`: 256 int32 header (magic, version, token count, zeros), then the tokens;
  magic 20240520 / version 1 holds uint16 tokens (GPT-2), magic 20240801 / version 7 uint32
  (Llama 3's 128k vocabulary): karpathy/llm.c dev/data/data_common.py, HEADERS_INFO and write_datafile.
- `.npy`: a 1-D integer array (numpy's format: magic, version, header dict, data).
"""

from __future__ import annotations

import ast
import glob
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INTS
# (magic, version) -> token dtype, as llm.c's write_datafile writes them.
LLMC_FORMATS = {(20240520, 1): "<u2", (20240801, 7): "<u4"}
LLMC_MAGICS = {magic for magic, _ in LLMC_FORMATS}
SHARD_SUFFIXES = (".bin", ".npy")
NPY_MAGIC = b"\x93NUMPY"
# A shard named like val.bin or fineweb_val_000000.bin (nanoGPT's and llm.c's names) is validation data.
_VAL_NAME = re.compile(r"(?:^|[_.-])val(?:[_.-]|\d|$)")


@dataclass(frozen=True)
class Shard:
    """One token file: `count` ids of numpy dtype `dtype` (e.g. '<u2') from byte `offset` on."""

    path: Path
    kind: str  # nanogpt | llmc | npy
    dtype: str
    offset: int
    count: int


def is_val_name(path: Path) -> bool:
    """Whether a shard's name marks it as validation data (val.bin, fineweb_val_000000.bin)."""
    return bool(_VAL_NAME.search(path.stem))


def find_files(spec: str, *, knob: str) -> tuple[list[Path], bool]:
    """The files `spec` names, in sorted order: one file, a folder's .bin / .npy files, or a glob.
    Also says whether `spec` was a folder (its val-named shards are then the validation split)."""
    path = Path(os.path.expanduser(spec))
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"{knob}={spec} matches no file: check the pattern")
        return files, False
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{knob}={spec} is a folder with no .bin or .npy shards in it")
        return files, True
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"{knob}={spec} does not exist: no such file, folder or glob match{where}")
    return [path], False


def read_shard(path: Path, *, knob: str) -> Shard:
    """The shard at `path`, from its suffix and header; a one-line error naming the file and
    `knob` for an unknown format, an empty shard or a header that disagrees with the file size."""
    size = path.stat().st_size
    if path.suffix == ".npy":
        shard = _read_npy(path, size, knob=knob)
    elif path.suffix == ".bin":
        shard = _read_bin(path, size, knob=knob)
    else:
        raise ValueError(f"{knob}: {path} has an unknown format {path.suffix or '(no suffix)'!r}: data=tokens reads "
                         ".bin (nanoGPT raw uint16 or llm.c headered) and .npy files; for text use data=text "
                         "or pipetrain-prepare")
    if shard.count == 0:
        raise ValueError(f"{knob}: {path} is an empty shard (0 tokens): remove it or regenerate it")
    return shard


def _read_bin(path: Path, size: int, *, knob: str) -> Shard:
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    magic = struct.unpack("<i", head[:4])[0] if len(head) >= 4 else None
    if magic not in LLMC_MAGICS:  # nanoGPT's raw uint16 (llm.c's magics are no GPT-2 token pair)
        _check_not_llmc(path, head, size, knob=knob)
        if size % 2:
            raise ValueError(f"{knob}: {path} has an odd number of bytes ({size}): a raw .bin holds uint16 token "
                             "ids (nanoGPT's format); for a text file use data=text")
        return Shard(path, "nanogpt", "<u2", 0, size // 2)
    if len(head) < LLMC_HEADER_BYTES:
        raise ValueError(f"{knob}: {path} starts with llm.c's magic {magic} but is shorter than its "
                         f"{LLMC_HEADER_BYTES}-byte header ({size} bytes): regenerate it")
    version, count = struct.unpack("<ii", head[4:12])
    dtype = LLMC_FORMATS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"magic {m} version {v}" for m, v in LLMC_FORMATS)
        raise ValueError(f"{knob}: {path} is an llm.c shard of unknown version {version} (magic {magic}): "
                         f"pipetrain reads {known}")
    want = LLMC_HEADER_BYTES + count * int(dtype[2])
    if size != want:
        raise ValueError(f"{knob}: {path}'s llm.c header says {count:,} tokens ({want:,} bytes with the header) "
                         f"but the file has {size:,} bytes: it is truncated or not an llm.c shard, regenerate it")
    return Shard(path, "llmc", dtype, LLMC_HEADER_BYTES, count)


def _check_not_llmc(path: Path, head: bytes, size: int, *, knob: str) -> None:
    """An llm.c header whose magic is wrong (three int32s, then 253 zeros) would be read as raw
    uint16 tokens, and its magic's halves as ids (20240519 gives 55431): say what it should be."""
    if len(head) < LLMC_HEADER_BYTES or size == LLMC_HEADER_BYTES or any(head[12:]) or not any(head[:4]):
        return
    magic, version, count = struct.unpack("<iii", head[:12])
    fits = [(m, v, d) for (m, v), d in LLMC_FORMATS.items() if size == LLMC_HEADER_BYTES + count * int(d[2])]
    want = " or ".join(f"magic {m} version {v} ({'uint16' if d == '<u2' else 'uint32'} tokens)"
                       for m, v, d in (fits or [(m, v, d) for (m, v), d in LLMC_FORMATS.items()]))
    raise ValueError(f"{knob}: {path} has an llm.c header ({count:,} tokens, then zeros) with magic {magic} version "
                     f"{version}, but llm.c's header for its size is {want}: fix its first int32s or regenerate it")


def _read_npy(path: Path, size: int, *, knob: str) -> Shard:
    with open(path, "rb") as f:
        head = f.read(12)
        if head[:6] != NPY_MAGIC or len(head) < 10:
            raise ValueError(f"{knob}: {path} is not a .npy file (no numpy magic): save it with numpy.save")
        major = head[6]
        # Format 1.0: a uint16 header length at byte 8; 2.0 and 3.0: a uint32 at byte 8.
        start, hlen = (10, struct.unpack("<H", head[8:10])[0]) if major == 1 else \
            (12, struct.unpack("<I", head[8:12])[0])
        f.seek(start)
        header = ast.literal_eval(f.read(hlen).decode("latin1"))
    descr, shape = header.get("descr"), header.get("shape")
    if not isinstance(descr, str) or len(descr) < 3 or descr[1] not in "iu":
        raise ValueError(f"{knob}: {path} holds {descr!r} values, not integers: save token ids as an integer "
                         "array (e.g. numpy.uint16 or numpy.uint32)")
    if not isinstance(shape, tuple) or len(shape) != 1:
        raise ValueError(f"{knob}: {path} is an array of shape {shape}, not 1-D: save the token stream flat "
                         "(array.reshape(-1))")
    offset, count = start + hlen, shape[0]
    if size < offset + count * int(descr[2:]):
        raise ValueError(f"{knob}: {path} is truncated: its header says {count:,} values: regenerate it")
    return Shard(path, "npy", descr, offset, count)


def find_shards(spec: str, *, knob: str) -> tuple[list[Shard], list[Shard]]:
    """(training shards, validation shards) of `spec`: a folder's val-named shards (val.bin,
    *_val_*.bin) are its validation split; a file or glob is all training data."""
    files, folder = find_files(spec, knob=knob)
    val = [p for p in files if folder and is_val_name(p)]
    train = [p for p in files if p not in val]
    if not train:
        raise ValueError(f"{knob}={spec} holds only validation shards ({', '.join(p.name for p in val)}): "
                         "point it at the training shards")
    return [read_shard(p, knob=knob) for p in train], [read_shard(p, knob=knob) for p in val]
