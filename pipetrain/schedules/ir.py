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
and its backward with ``&``: ``0F6&7BW2``. A hand-written schedule may also spell out
its point-to-point plan with torch.distributed.pipelining's communication actions
``0SEND_F3``, ``1RECV_F3``, ``1SEND_B3``, ``0RECV_B3`` (see schedules/p2p.py); without
them the plan is derived.

CSV form (`schedule.csv`): one row per rank, written in torch.distributed.pipelining's
action names so torch's own loader (`_Action.from_str`, `_load_csv`) reads it: ``F``
forward, ``I`` input gradient (our B), ``W`` weight gradient, ``B`` full backward (our BW),
an overlapped pair as torch writes it, ``(0F6;7B2)OVERLAP_F_B``. `from_csv` reads that and
pipetrain's own form above (a file with ``BW`` or ``&`` is ours, one with ``I`` or
``OVERLAP_F_B`` is torch's; with neither, ``B`` is our input gradient if the file has a
``W``, else torch's full backward, the only reading under which it is complete).

Under data parallel, ``{stage}REDUCE_GRAD`` (torch's name too) marks where a rank reduces
stage s's gradients over its data-parallel group: once per step, after the stage's last
weight gradient (reduce.py derives the places; validate.py checks hand-written ones).

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
_COMM_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")
_REDUCE_RE = re.compile(r"^(\d+)REDUCE_GRAD$")
# torch.distributed.pipelining's compute names <-> ours (its B is the full backward)
_TO_TORCH = {Op.F: "F", Op.B: "I", Op.W: "W", Op.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_TORCH_ACTION_RE = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")


class CommOp(str, enum.Enum):
    """Explicit communication in a hand-written schedule (torch.distributed.pipelining's names)."""

    SEND_F = "SEND_F"  # stage s sends its forward output of microbatch m
    RECV_F = "RECV_F"  # stage s receives its forward input of microbatch m
    SEND_B = "SEND_B"  # stage s sends the gradient of its input
    RECV_B = "RECV_B"  # stage s receives the gradient of its output


@dataclass(frozen=True, slots=True)
class Comm:
    """`0SEND_F3`: one point-to-point operation, issued on its own, where it stands in the list."""

    op: CommOp
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"


@dataclass(frozen=True, slots=True)
class Reduce:
    """`3REDUCE_GRAD`: reduce stage 3's gradients over the data-parallel group (issued here,
    waited for at the end of the step, so it overlaps what the rank does after it)."""

    stage: int

    def __str__(self) -> str:
        return f"{self.stage}REDUCE_GRAD"


Marker = Union[Comm, Reduce]  # cells that stand between steps and take no compute


def parse_comm(text: str) -> Comm | None:
    m = _COMM_RE.match(text.strip())
    return None if m is None else Comm(CommOp(m.group(2)), int(m.group(1)), int(m.group(3)))


def parse_action(text: str, *, torch_names: bool = False) -> Action:
    """`5B1` in pipetrain's names, or with `torch_names` `5I1` (torch's B is our BW)."""
    m = (_TORCH_ACTION_RE if torch_names else _ACTION_RE).match(text.strip())
    if m is None:
        ops = ("F, I (input gradient), W, B (full backward), e.g. 0F3, 1B2" if torch_names
               else "F, B, W, BW (e.g. 0F3, 1BW2)")
        raise ValueError(f"cannot parse action {text!r}: write {{stage}}{{op}}{{microbatch}} with op one of {ops}")
    return Action(_FROM_TORCH[m.group(2)] if torch_names else Op(m.group(2)), int(m.group(1)), int(m.group(3)))


def parse_step(text: str) -> Step:
    """Parse `0F3` or an overlapped pair `0F3&7BW1` (forward first)."""
    text = text.strip()
    if "&" in text:
        pieces = text.split("&")
        if len(pieces) != 2:
            raise ValueError(f"cannot parse {text!r}: an F&B pair joins exactly two actions with '&'")
        return Overlap(parse_action(pieces[0]), parse_action(pieces[1]))
    return parse_action(text)


def parse_cell(text: str) -> Step | Marker:
    """A step (`0F3`, `0F3&7BW1`), an explicit communication (`0SEND_F3`, `1RECV_B2`) or a
    gradient reduction (`3REDUCE_GRAD`)."""
    comm = parse_comm(text)
    if comm is not None:
        return comm
    reduce = _REDUCE_RE.match(text.strip())
    if reduce is not None:
        return Reduce(int(reduce.group(1)))
    try:
        return parse_step(text)
    except ValueError as e:
        raise ValueError(
            f"{e}, or a communication {{stage}}{{SEND_F|RECV_F|SEND_B|RECV_B}}{{microbatch}}, or {{stage}}REDUCE_GRAD"
        ) from None


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered steps plus the placement that says which rank holds which stage."""

    name: str
    placement: Placement
    num_microbatches: int
    steps: tuple[tuple[Step, ...], ...]
    # Hand-written point-to-point plan, if the file spells one out: per rank, (boundary, op)
    # with boundary = the number of atomic actions before it. Empty: derived (schedules/p2p.py).
    comms: tuple[tuple[tuple[int, Comm], ...], ...] = ()
    # Gradient reductions over the data-parallel group, per rank (boundary, Reduce); empty
    # when the schedule has none (no data parallel, or not yet placed: schedules/reduce.py).
    reduces: tuple[tuple[tuple[int, Reduce], ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.steps) != self.placement.num_ranks:
            raise ValueError(
                f"schedule {self.name!r} has {len(self.steps)} ranks of steps but its placement "
                f"has {self.placement.num_ranks} ranks"
            )

    @classmethod
    def build(
        cls, name: str, placement: Placement, num_microbatches: int, steps: Sequence[Sequence[Step | Marker]]
    ) -> "Schedule":
        """Rows of steps; `Comm` cells, if any, become the schedule's explicit point-to-point
        plan, `Reduce` cells its gradient reductions."""
        rows, comms, reduces = [], [], []
        for row in steps:
            kept: list[Step] = []
            mine: list[tuple[int, Comm]] = []
            red: list[tuple[int, Reduce]] = []
            parts = 0
            for cell in row:
                if isinstance(cell, Comm):
                    mine.append((parts, cell))
                elif isinstance(cell, Reduce):
                    red.append((parts, cell))
                else:
                    kept.append(cell)
                    parts += len(cell.parts())
            rows.append(tuple(kept))
            comms.append(tuple(mine))
            reduces.append(tuple(red))
        return cls(name, placement, num_microbatches, tuple(rows), tuple(comms) if any(comms) else (),
                   tuple(reduces) if any(reduces) else ())

    def cells(self, rank: int) -> list[Step | Marker]:
        """The rank's list as written: steps with explicit communication and reductions in their
        places (at one boundary: reductions first, they belong to the step before)."""
        markers: list[tuple[int, int, Marker]] = [(b, 0, r) for b, r in (self.reduces[rank] if self.reduces else ())]
        markers += [(b, 1, c) for b, c in (self.comms[rank] if self.comms else ())]
        markers.sort(key=lambda t: (t[0], t[1]))
        out: list[Step | Marker] = []
        parts = 0
        for step in self.steps[rank]:
            while markers and markers[0][0] <= parts:
                out.append(markers.pop(0)[2])
            out.append(step)
            parts += len(step.parts())
        out += [m for _, _, m in markers]
        return out

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
            f"rank {r}: " + " ".join(str(s) for s in self.cells(r)) for r in range(self.num_ranks)
        )

    @classmethod
    def from_text(
        cls, text: str, *, name: str, placement: Placement, num_microbatches: int
    ) -> "Schedule":
        rows: list[list[Step | Marker]] = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, body = line.partition(":")
            rank = head.strip()[4:].strip()
            if not sep or not head.strip().startswith("rank") or not rank.isdigit():
                raise ValueError(f"line {lineno}: cannot parse schedule line {line!r}: expected 'rank R: 0F0 0F1 ...' "
                                 f"with R the rank's number (0, 1, ...)")
            if int(rank) != len(rows):
                raise ValueError(f"line {lineno}: schedule lines must list ranks in order 0, 1, ...; got rank {rank} "
                                 f"where rank {len(rows)} was due")
            try:
                rows.append([parse_cell(tok) for tok in body.split()])
            except ValueError as e:
                raise ValueError(f"line {lineno}: {e}") from None
        return cls.build(name, placement, num_microbatches, rows)

    def to_csv(self) -> str:
        """CSV for hand editing and for torch.distributed.pipelining: one row per rank, one
        cell per step, in torch's action names (module docstring)."""
        return "\n".join(",".join(torch_cell(c) for c in self.cells(r)) for r in range(self.num_ranks)) + "\n"

    @classmethod
    def from_csv(
        cls, text: str, *, name: str, placement: Placement, num_microbatches: int
    ) -> "Schedule":
        """Parse the CSV form, torch's names or pipetrain's (module docstring). Blank cells are
        ignored; lines starting with '#' are comments."""
        lines = [(n, ln) for n, ln in enumerate(text.splitlines(), start=1)
                 if ln.strip() and not ln.strip().startswith("#")]
        cells = [[c.strip() for c in ln.split(",") if c.strip()] for _, ln in lines]
        torch_names = _is_torch_dialect([c for row in cells for c in row])
        parse = parse_torch_cell if torch_names else parse_cell
        rows: list[list[Step | Marker]] = []
        for (lineno, _), row in zip(lines, cells):
            try:
                rows.append([parse(c) for c in row])
            except ValueError as e:
                raise ValueError(f"line {lineno}: {e}") from None
        return cls.build(name, placement, num_microbatches, rows)


_TORCH_OVERLAP_RE = re.compile(r"^\(([^;()]+);([^;()]+)\)OVERLAP_F_B$")
_OURS_ONLY = re.compile(r"^\d+BW\d+$|&")
_TORCH_ONLY = re.compile(r"^\d+I\d+$|OVERLAP_F_B")


def torch_action(action: Action) -> str:
    """`5B1` (our input gradient) -> `5I1`; `2BW0` -> `2B0`."""
    return f"{action.stage}{_TO_TORCH[action.op]}{action.microbatch}"


def torch_cell(cell: Step | Marker) -> str:
    """One cell as torch writes it; an overlapped pair as `(0F6;7B2)OVERLAP_F_B`."""
    if isinstance(cell, Action):
        return torch_action(cell)
    if isinstance(cell, Overlap):
        return f"({torch_action(cell.forward)};{torch_action(cell.backward)})OVERLAP_F_B"
    return str(cell)  # SEND_F/RECV_F/SEND_B/RECV_B and REDUCE_GRAD are spelled alike


def parse_torch_cell(text: str) -> Step | Marker:
    """A cell in torch's names: `0F3`, `1I2`, `(0F6;7B2)OVERLAP_F_B`, or a communication /
    REDUCE_GRAD marker."""
    text = text.strip()
    pair = _TORCH_OVERLAP_RE.match(text)
    if pair is not None:
        return Overlap(parse_action(pair.group(1), torch_names=True), parse_action(pair.group(2), torch_names=True))
    if _TORCH_ACTION_RE.match(text):
        return parse_action(text, torch_names=True)
    return parse_cell(text)  # markers; anything else fails there with the full list


def _is_torch_dialect(cells: list[str]) -> bool:
    ours = any(_OURS_ONLY.search(c) for c in cells)
    theirs = any(_TORCH_ONLY.search(c) for c in cells)
    if ours and theirs:
        raise ValueError(
            "the schedule mixes pipetrain's names (BW, '&' pairs) with torch's (I, OVERLAP_F_B): "
            "write every cell in one of them"
        )
    if ours or theirs:
        return theirs
    # F, B, W only: with a W, B must be the input gradient (ours); without, torch's full backward
    return not any(re.match(r"^\d+W\d+$", c) for c in cells)
