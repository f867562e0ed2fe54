"""One line per setting, read from the schemas' own comments (what `pipetrain --help` prints).

A setting's description is the comment on its line (`degree: int = 2  # P: pipeline ranks`),
else the comment block right above it, cut after its first sentence so every setting stays
one line. The comments are the documentation: a setting without one is a bug
(tests/test_help.py). Pure Python: reads source with `inspect`, `ast` and `tokenize`.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class Setting:
    key: str  # dotted, as typed on the command line: pipeline.degree
    default: str  # as a user would write it: 2, null, [console,jsonl]
    doc: str  # one line; "" when the schema has no comment for it


@functools.cache
def _own_docs(cls: type) -> dict[str, str]:
    """Comments of the fields a class itself declares."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = node.end_lineno or node.lineno
        doc = comments.get(line, "") if line in comments and lines[line - 1].lstrip()[:1] != "#" else ""
        if not doc:
            above, n = [], node.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            doc = first_sentence(" ".join(above))
        out[node.target.id] = doc
    return out


def first_sentence(text: str) -> str:
    """Up to the end of the first sentence of at least 40 characters (one line in --help)."""
    cut = text.find(". ", 40)
    return text if cut < 0 else text[: cut + 1]


def field_docs(cls: type) -> dict[str, str]:
    """Field -> description, inherited fields included (a subclass's own comment wins)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update({k: v for k, v in _own_docs(base).items() if v or k not in out})
    return out


def _default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_default_text(v) for v in value) + "]"
    return str(value)


def _nested_schema(annotation: Any) -> type | None:
    """The dataclass a field holds (Optional[X] included), else None (a list of them, data.sources, is one
    setting: its entries are not keys of their own)."""
    if typing.get_origin(annotation) in (list, tuple):
        return None
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return next((a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)), None)


def settings(schema: type, prefix: str) -> Iterator[Setting]:
    """Every setting of a schema with its default and one-line description; a nested
    dataclass (model.rope_scaling) lists its own settings under its key."""
    docs = field_docs(schema)
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}.{f.name}" if prefix else f.name
        nested = _nested_schema(hints.get(f.name))
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if nested is not None and value is not None:
            yield from settings(nested, key)
        else:
            yield Setting(key, _default_text(value), docs.get(f.name, ""))
