"""Schedule IR: what each pipeline rank does, in order, as plain data.

A schedule is, for every rank, an ordered list of steps. A step is either one
`Action` on a (stage, microbatch) or an `Overlap` pair ("F&B", DualPipe's
overlapped forward of one microbatch with a backward of another).

Operation names follow the zero-bubble papers, spelled out so they never mean
two things:

  F   forward
  B   backward w.r.t. the stage *input* only (the activation gradient)
  W   backward w.r.t. the stage *weights* (needs what B kept)
  BW  full backward (B and W together)

Text form (parses back exactly): an action is ``{stage}{op}{microbatch}``,
e.g. ``0F3``, ``5B1``, ``5W1``, ``2BW0``; an overlapped pair joins its forward
and its backward with ``&``: ``0F6&7BW2``.

This module imports no torch (a test enforces it for all of `schedules/`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterator, Sequence, Union

from pipetrain.schedules.placement import Placement


class Op(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    @property
    def is_backward(self) -> bool:
        return self in (Op.B, Op.BW)


@dataclass(frozen=True, slots=True)
class Action:
    op: Op
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    def parts(self) -> tuple["Action", ...]:
        return (self,)


@dataclass(frozen=True, slots=True)
class Overlap:
    """`F&B`: a forward and a backward (B or BW) of different microbatches run together."""

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if self.forward.op is not Op.F:
            raise ValueError(f"F&B pair needs a forward first, got {self.forward}")
        if not self.backward.op.is_backward:
            raise ValueError(f"F&B pair needs a B or BW second, got {self.backward}")

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"

    def parts(self) -> tuple[Action, ...]:
        return (self.forward, self.backward)


Step = Union[Action, Overlap]

_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if m is None:
        raise ValueError(
            f"cannot parse action {text!r}: write {{stage}}{{op}}{{microbatch}} with op one of "
            "F, B, W, BW (e.g. 0F3, 1BW2)"
        )
    return Action(Op(m.group(2)), int(m.group(1)), int(m.group(3)))


def parse_step(text: str) -> Step:
    """Parse `0F3` or an overlapped pair `0F3&7BW1` (forward first)."""
    text = text.strip()
    if "&" in text:
        pieces = text.split("&")
        if len(pieces) != 2:
            raise ValueError(f"cannot parse {text!r}: an F&B pair joins exactly two actions with '&'")
        return Overlap(parse_action(pieces[0]), parse_action(pieces[1]))
    return parse_action(text)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered steps plus the placement that says which rank holds which stage."""

    name: str
    placement: Placement
    num_microbatches: int
    steps: tuple[tuple[Step, ...], ...]

    def __post_init__(self) -> None:
        if len(self.steps) != self.placement.num_ranks:
            raise ValueError(
                f"schedule {self.name!r} has {len(self.steps)} ranks of steps but its placement "
                f"has {self.placement.num_ranks} ranks"
            )

    @classmethod
    def build(
        cls, name: str, placement: Placement, num_microbatches: int, steps: Sequence[Sequence[Step]]
    ) -> "Schedule":
        return cls(name, placement, num_microbatches, tuple(tuple(r) for r in steps))

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def actions(self, rank: int) -> Iterator[Action]:
        """The atomic actions of one rank in order (an F&B pair yields its two parts)."""
        for step in self.steps[rank]:
            yield from step.parts()

    def chain_of(self, microbatch: int) -> int:
        """Index of the placement chain (pipeline direction) this microbatch flows through."""
        return self.placement.chain_of(microbatch, self.num_microbatches)

    def to_text(self) -> str:
        """One line per rank, `rank R: step step ...`; `from_text` parses it back."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(s) for s in steps) for r, steps in enumerate(self.steps)
        )

    @classmethod
    def from_text(
        cls, text: str, *, name: str, placement: Placement, num_microbatches: int
    ) -> "Schedule":
        rows: list[list[Step]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, body = line.partition(":")
            if not sep or not head.strip().startswith("rank"):
                raise ValueError(f"cannot parse schedule line {line!r}: expected 'rank R: 0F0 0F1 ...'")
            rank = int(head.strip()[4:])
            if rank != len(rows):
                raise ValueError(f"schedule lines must list ranks in order 0, 1, ...; got rank {rank}")
            rows.append([parse_step(tok) for tok in body.split()])
        return cls.build(name, placement, num_microbatches, rows)

    def to_csv(self) -> str:
        """CSV form for hand editing: one row per rank, one cell per step."""
        return "\n".join(",".join(str(s) for s in steps) for steps in self.steps) + "\n"

    @classmethod
    def from_csv(
        cls, text: str, *, name: str, placement: Placement, num_microbatches: int
    ) -> "Schedule":
        """Parse the CSV form. Blank cells are ignored; lines starting with '#' are comments."""
        rows: list[list[Step]] = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip().startswith("#"):
                continue
            cells = [c.strip() for c in line.split(",")]
            if not any(cells) and not line.strip():
                continue
            try:
                rows.append([parse_step(c) for c in cells if c])
            except ValueError as e:
                raise ValueError(f"line {lineno}: {e}") from None
        return cls.build(name, placement, num_microbatches, rows)
