"""Checkpoints on disk: where they are, whether each is whole, which one to resume, which to delete.

Layout: <run_dir>/checkpoints/step_000123/ (a save in progress is .step_000123.tmp, see
train/checkpoint.py). Pure: no torch, so the CLI checks trainer.resume before any rank starts.

Is a checkpoint whole? Its manifest, written with it and checked before loading.

meta.json (the last file of a save, train/checkpoint.py) carries `files`: every other file of
the checkpoint (DCP's `.metadata` and each rank's `.distcp` tensor data) with its size and sha256.
Before a checkpoint is loaded its files are checked against it, so a truncated or deleted shard,
bytes changed inside tensor data, a garbage meta.json or a missing `.metadata` are found by name
before DCP reads them (DCP itself would fail in every rank, or load the damaged values silently).

`damage(path)` says what is wrong, in a few words, or None. `deep=False` checks sizes only (a
cheap look, for retention and `trainer.resume=auto` before launching); `deep=True` reads every
byte (the CLI for an explicit trainer.resume=PATH; before the ranks load, every rank hashes its
`share` of the files and they agree on a verdict: train/checkpoint_pick.py, through `check_bytes`).

A damaged newest checkpoint is reported by name and why, and the previous good one is used
(`trainer.resume=auto`, or a run directory); one named explicitly is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

CKPT_DIR = "checkpoints"
META = "meta.json"
DCP_METADATA = ".metadata"  # written by DCP's coordinator once every rank's data is on disk
REQUIRED = ("format", "step", "tokens", "world_size", "fingerprint")  # keys meta.json must hold
_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")

Note = Callable[[str], None]  # where a message for the user goes
Files = Mapping[str, Mapping[str, Any]]  # a manifest: file name -> {"bytes": n, "sha256": hex}
# the byte check of a checkpoint whose sizes are right: (directory, its manifest) -> what is wrong, or None
CheckBytes = Callable[[Path, Files], Optional[str]]


def silent(text: str) -> None:
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest(directory: Path, pattern: str = "*", *, known: Optional[dict[str, dict[str, Any]]] = None
             ) -> dict[str, dict[str, Any]]:
    """Files of a staged checkpoint (before meta.json is added) matching `pattern`: name -> bytes and
    sha256; entries in `known` (hashed by the rank that wrote them) are taken as they are."""
    known = dict(known or {})
    for p in sorted(Path(directory).glob(pattern)):
        if p.is_file() and p.name != META and p.name not in known:
            known[p.name] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    return dict(sorted(known.items()))


def read_meta_checked(path: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """meta.json's content, or why it cannot be used."""
    file = Path(path) / META
    if not file.is_file():
        return None, f"no {META} (not a finished save)"
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{META} is not valid JSON ({str(e).splitlines()[0]})"
    if not isinstance(meta, dict):
        return None, f"{META} is not a JSON object"
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        return None, f"{META} lacks {', '.join(repr(k) for k in missing)}"
    return meta, None


def manifest_damage(files: Any) -> Optional[str]:
    """What is wrong with meta.json's `files` itself, or None: a damaged manifest is damage like
    any other (reported by name, the previous checkpoint used), not a KeyError in every rank."""
    if not isinstance(files, dict):
        return f"{META}'s files is not a manifest (a JSON object of file -> bytes and sha256)"
    for name in sorted(files, key=check_order):
        entry = files[name]
        lacks = [k for k, kind in (("bytes", int), ("sha256", str)) if not isinstance(entry, dict)
                 or not isinstance(entry.get(k), kind) or isinstance(entry.get(k), bool)]
        if lacks:
            return f"{META}'s manifest entry for {name} lacks {' and '.join(repr(k) for k in lacks)}"
    return None


def check_order(name: str) -> tuple[bool, str]:
    """The order files are checked and reported in: DCP's index first, then by name."""
    return name != DCP_METADATA, name


def hash_damage(path: Path, files: Files, *, read: Callable[[Path], str] = sha256) -> Optional[tuple[str, str]]:
    """The first of `files` (in check order) whose bytes do not match its sha256: (name, why), or None.
    `read`: a file's sha256 (hex)."""
    for name in sorted(files, key=check_order):
        if read(Path(path) / name) != files[name]["sha256"]:
            return name, f"{name} does not match its sha256 in the manifest (its bytes changed)"
    return None


def share(files: Files, world: int) -> list[list[str]]:
    """The files each of `world` ranks hashes: largest first to the least loaded rank (ties: the
    lowest), so every rank reads about 1/world of the bytes; the same on every rank."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-int(files[n]["bytes"]), n)):
        r = min(range(world), key=lambda i: (loads[i], i))
        out[r].append(name)
        loads[r] += int(files[name]["bytes"])
    return [sorted(names, key=check_order) for names in out]


def _check_all(path: Path, files: Files) -> Optional[str]:
    found = hash_damage(path, files)
    return None if found is None else found[1]


def damage(path: Path, *, deep: bool = True, check_bytes: Optional[CheckBytes] = None) -> Optional[str]:
    """What is wrong with the checkpoint directory `path`, or None when it is whole. deep: the
    bytes too, by `check_bytes` (default: this process hashes every file)."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    if not any(path.iterdir()):
        return "empty directory"
    meta, why = read_meta_checked(path)
    if why:
        return why
    assert meta is not None
    if not (path / DCP_METADATA).is_file():
        return f"no {DCP_METADATA} (DCP's index of the tensors)"
    files = meta.get("files")
    if files is None:  # written before manifests: nothing to check the bytes against
        return None
    why = manifest_damage(files)
    if why:
        return why
    for name in sorted(files, key=check_order):
        file, want = path / name, files[name]
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
    return (check_bytes or _check_all)(path, files) if deep else None


# ---- which checkpoint ---------------------------------------------------------------------------


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step_{step:06d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step_* directory under `root`, whole or not, oldest first (.step_*.tmp are saves in progress)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The step_* directories under `root` that look whole (sizes checked, not bytes), oldest first."""
    return [(s, p) for s, p in step_dirs(root) if damage(p, deep=False) is None]


def newest_good(root: Path, *, deep: bool = False, note: Note = silent,
                check_bytes: Optional[CheckBytes] = None) -> Optional[Path]:
    """The newest whole checkpoint under `root` (None: there is none). Damaged newer ones are
    reported by name and why; when every one is damaged the run refuses rather than start over."""
    bad: list[str] = []
    for _, path in reversed(step_dirs(root)):
        why = damage(path, deep=deep, check_bytes=check_bytes)
        if why is None:
            for text in bad:
                note(f"checkpoint: {text}: resuming from {path.name} instead")
            return path
        bad.append(f"{path.name} is damaged ({why})")
    if bad:
        raise ValueError(f"trainer.resume: no whole checkpoint in {root}: {'; '.join(bad)}: move them away, or "
                         f"use a new run.name, to start over")
    return None


FRESH = ("never", "", "null", "none", "None")  # trainer.resume values (besides None) that start fresh


def refuse_overwrite(resume: Optional[str], run_dir: Path) -> None:
    """trainer.resume=never (or null) on training: a fresh start, refused in one line where the run
    directory already holds checkpoints, which its own saves would overwrite step by step."""
    if resume is not None and resume not in FRESH:
        return
    held = step_dirs(Path(run_dir) / CKPT_DIR)
    if held:
        raise ValueError(f"trainer.resume={resume or 'never'} starts fresh, but {Path(run_dir) / CKPT_DIR} holds "
                         f"{len(held)} checkpoint(s) (newest {held[-1][1].name}) it would overwrite: use a new "
                         f"run.name, or trainer.resume=auto to continue from the newest")


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    ckpts = list_checkpoints(Path(run_dir) / CKPT_DIR)
    return ckpts[-1][1] if ckpts else None


def resolve_resume(resume: Optional[str], run_dir: Path, *, deep: bool = False, note: Note = silent,
                   check_bytes: Optional[CheckBytes] = None) -> Optional[Path]:
    """The checkpoint trainer.resume names, or None to start fresh. `auto`: the newest good one in
    this run directory (none: None). A path: a step_* directory (refused in one line if damaged),
    or a run / checkpoints directory (its newest good one). Errors are one line."""
    by = {"deep": deep, "note": note, "check_bytes": check_bytes}
    if resume is None or resume in FRESH:
        return None
    if resume == "auto":
        return newest_good(Path(run_dir) / CKPT_DIR, **by)
    path = Path(resume).expanduser()
    hint = "set trainer.resume to a checkpoints/step_* directory, to auto, or to never"
    if not path.exists():
        raise ValueError(f"trainer.resume={resume}: no such checkpoint directory: {hint}")
    if _STEP_DIR.match(path.name) or (path / META).exists():
        why = damage(path, deep=deep, check_bytes=check_bytes)
        if why:
            raise ValueError(f"trainer.resume={resume}: {path.name} is damaged ({why}): resume from an older "
                             f"checkpoint in {path.parent}, or set trainer.resume=auto to take the newest good one")
        return path
    for root in (path, path / CKPT_DIR):
        if step_dirs(root):
            return newest_good(root, **by)
    raise ValueError(f"trainer.resume={resume}: not a complete checkpoint (no {META} and {DCP_METADATA}): {hint}")


def prune(run_dir: Path, keep_last: int, *, note: Note = silent) -> list[Path]:
    """checkpoint.keep_last: delete the checkpoints older than the newest `keep_last` good ones
    (damaged ones older than those too). The newest good one is always kept; 0 keeps all."""
    if keep_last < 1:
        return []
    good = list_checkpoints(Path(run_dir) / CKPT_DIR)
    if len(good) <= keep_last:
        return []
    oldest_kept = good[-keep_last][0]
    gone = [p for s, p in step_dirs(Path(run_dir) / CKPT_DIR) if s < oldest_kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    if gone:
        note(f"checkpoint: deleted {', '.join(p.name for p in gone)} (checkpoint.keep_last={keep_last})")
    return gone
