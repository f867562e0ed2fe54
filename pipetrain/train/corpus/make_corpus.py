"""Rebuild pipetrain's built-in corpus from the docstrings of Python's standard library.

    python pipetrain/train/corpus/make_corpus.py   # writes stdlib_docs.txt.gz beside itself

Why this text: it is English prose (what a byte-level GPT can learn from in a few dozen
steps), it is on every machine that runs Python (nothing is downloaded), and it is under
the PSF License, which allows derived works that keep Python's licence and copyright notice
(copied next to the corpus as LICENSE-PSF.txt) and say what was changed (README.md there).

Deterministic: modules in sorted path order, paragraphs in source order, exact duplicates
dropped, gzip without a timestamp. The shipped file was made with CPython 3.11.7; another
Python version gives a similar but not byte-identical corpus, which is why the result is
committed rather than rebuilt at install time.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import re
import shutil
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent  # beside this script: pipetrain/train/corpus
TARGET_BYTES = 1_000_000  # ~1 MB: ~7,800 windows of 128 tokens, ample for the quickstart's 60 x 8 sequences
# Tests, tool scripts and generated tables: little prose, much code or data.
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__phello__", "encodings",
              "turtledemo", "pydoc_data", "ensurepip", "venv"}
WORD = re.compile(r"[A-Za-z]+")


def stdlib_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one file, in source order."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):  # a few stdlib files are templates or Python 2
        return
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc


def is_prose(paragraph: str) -> bool:
    """A paragraph of English sentences: no doctest, no code or table layout, mostly words."""
    lines = paragraph.splitlines()
    if any(line.startswith((" ", "\t", ">>>", "...", "$", "%")) for line in lines):
        return False  # indented blocks are examples, signatures or tables
    text = " ".join(lines)
    if not text.isascii() or not text.isprintable():
        return False
    words = WORD.findall(text)
    if len(words) < 8 or not text.rstrip().endswith((".", ":", "?", "!", ")")):
        return False
    letters = sum(len(w) for w in words)
    return letters / len(text) > 0.68 and text.count("_") < 6 and text.count("(") < 8


def paragraphs(files: list[Path]) -> Iterator[str]:
    seen: set[str] = set()
    for path in files:
        for doc in docstrings(path):
            for para in re.split(r"\n\s*\n", doc):
                if not is_prose(para):
                    continue
                flat = " ".join(para.split())
                if flat not in seen:
                    seen.add(flat)
                    yield textwrap.fill(flat, width=79)


def build(root: Path, target: int = TARGET_BYTES) -> str:
    out, size = [], 0
    for para in paragraphs(stdlib_files(root)):
        if size + len(para) + 2 > target:
            break
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--bytes", type=int, default=TARGET_BYTES)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    text = build(root, args.bytes)
    args.out.mkdir(parents=True, exist_ok=True)
    # mtime=0 and no file name in the header: the same text always gives the same bytes.
    with open(args.out / "stdlib_docs.txt.gz", "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("ascii"))
    shutil.copyfile(root / "LICENSE.txt", args.out / "LICENSE-PSF.txt")
    print(f"{len(text):,} bytes from {root} -> {args.out / 'stdlib_docs.txt.gz'}")


if __name__ == "__main__":
    main()
