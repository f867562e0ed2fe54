"""All point-to-point communication of the pipeline, derived from the schedule.

Which tensors cross ranks is a pure function of the placement and the actions:

  F(s, m)      sends its output ("act", s, m) to the rank of next(s), if that is another rank
  B/BW(s, m)   sends its input grad ("grad", s, m) to the rank of prev(s), likewise

so every rank knows, before a step starts, every message it will send and receive, with
shapes and dtypes from the model (no per-message negotiation). Receives are all posted
at the start of the step (in the order the sender sends them, so the pattern is also
safe for NCCL, which matches point-to-point operations in order); sends are
asynchronous and only waited for at the end of the step. Every wait has a timeout, and
a timeout or a dead peer raises `P2PError` naming this rank, the action and the peer.

We use plain isend/irecv with a unique tag per message rather than
`batch_isend_irecv`, which has been reported to hang with gloo (pytorch/PiPPy#989,
pytorch/pytorch#132644); tests run many steps back to back to keep us honest.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pipetrain.schedules.ir import Action, Op, Schedule


class P2PError(RuntimeError):
    """A point-to-point wait failed: timed out, or the peer is gone."""


@dataclass(frozen=True)
class Message:
    kind: str  # "act": forward output of `stage`; "grad": gradient w.r.t. the input of `stage`
    stage: int
    microbatch: int
    src: int
    dst: int

    def tag(self, schedule: Schedule) -> int:
        return (self.stage * schedule.num_microbatches + self.microbatch) * 2 + (self.kind == "grad")

    def describe(self) -> str:
        what = "activation" if self.kind == "act" else "input gradient"
        return f"{what} of {self.stage}{'F' if self.kind == 'act' else 'B'}{self.microbatch}"


def sent_by(action: Action, schedule: Schedule, rank: int) -> Optional[Message]:
    """The message an action sends to another rank, if any."""
    pl = schedule.placement
    s, m = action.stage, action.microbatch
    if action.op is Op.F:
        peer_stage = pl.next_stage(s)
        kind = "act"
    elif action.op in (Op.B, Op.BW):
        peer_stage = pl.prev_stage(s)
        kind = "grad"
    else:
        return None
    if peer_stage is None or pl.rank_of(peer_stage) == rank:
        return None
    return Message(kind, s, m, rank, pl.rank_of(peer_stage))


def needed_by(action: Action, schedule: Schedule, rank: int) -> Optional[Message]:
    """The message an action must receive from another rank, if any."""
    pl = schedule.placement
    s, m = action.stage, action.microbatch
    if action.op is Op.F:
        src_stage, kind = pl.prev_stage(s), "act"
    elif action.op in (Op.B, Op.BW):
        src_stage, kind = pl.next_stage(s), "grad"
    else:
        return None
    if src_stage is None or pl.rank_of(src_stage) == rank:
        return None
    return Message(kind, src_stage, m, pl.rank_of(src_stage), rank)


def incoming(schedule: Schedule, rank: int, *, forward_only: bool = False) -> list[Message]:
    """Messages this rank receives in one step, ordered per sender as the sender sends them."""
    out = []
    for src in range(schedule.num_ranks):
        if src == rank:
            continue
        for action in schedule.actions(src):
            msg = sent_by(action, schedule, src)
            if msg is not None and msg.dst == rank and (msg.kind == "act" or not forward_only):
                out.append(msg)
    return out


class P2P:
    """Point-to-point transport for one rank over a torch.distributed process group."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        *,
        timeout_s: float,
        group: Optional[dist.ProcessGroup] = None,
        group_ranks: Optional[list[int]] = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group
        # pipeline rank -> global rank in the default group (identity for a pure-PP job)
        self._global = group_ranks or list(range(schedule.num_ranks))
        self._recvs: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self._sends: list[tuple[Message, torch.Tensor, dist.Work]] = []

    def post_receives(self, buffer_for: Callable[[Message], torch.Tensor], *, forward_only: bool = False) -> None:
        for msg in incoming(self.schedule, self.rank, forward_only=forward_only):
            buf = buffer_for(msg)
            work = dist.irecv(buf, src=self._global[msg.src], group=self.group, tag=msg.tag(self.schedule))
            self._recvs[msg] = (buf, work)

    def receive(self, msg: Message, *, action: str) -> torch.Tensor:
        buf, work = self._recvs.pop(msg)
        self._wait(work, f"{action} waiting for the {msg.describe()} from rank {msg.src}", msg.src)
        return buf

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, dst=self._global[msg.dst], group=self.group, tag=msg.tag(self.schedule))
        self._sends.append((msg, tensor, work))  # keep the tensor alive until the send completes

    def finish(self) -> None:
        """Wait for every send of the step; fail if a receive was posted but never consumed."""
        for msg, _, work in self._sends:
            self._wait(work, f"end of step waiting for rank {msg.dst} to take the {msg.describe()}", msg.dst)
        self._sends.clear()
        if self._recvs:
            left = ", ".join(m.describe() for m in self._recvs)
            raise P2PError(f"rank {self.rank}: receives never consumed this step: {left}")

    def _wait(self, work: dist.Work, what: str, peer: int) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as e:
            text = str(e)
            if "imed out" in text:
                raise P2PError(
                    f"rank {self.rank}: {what} timed out after {self.timeout.total_seconds():g}s: rank {peer} is "
                    f"stuck or dead (raise pipeline.p2p_timeout_s if it is only slow)"
                ) from None
            raise P2PError(
                f"rank {self.rank}: {what} failed: the connection to rank {peer} was lost, so that rank (or one it "
                f"depends on) died; pipeline.p2p_timeout_s bounds every wait"
            ) from None
        if ok is False:
            raise P2PError(f"rank {self.rank}: {what} did not complete (rank {peer})")
