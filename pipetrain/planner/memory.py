"""Memory of one pipeline rank at its peak: what the planner checks against the device budget.

  states       parameters, gradients, fp32 master copy and optimizer state: the rank's stored
               parameters x bytes per parameter (StateBytes), divided by the FSDP shard degree
               (FSDP2 shards all four; plain data-parallel replicas each hold everything).
  activations  what the rank's stages keep for their backwards, at the worst moment of the
               simulated timeline: a microbatch's activations on a stage appear at the start
               of its F; B frees all but the share W needs (`w_keep`, zero-bubble's split: W
               needs the inputs of the linear layers), W frees the rest; BW frees all at once.
               Per layer and token: the model's analytic bytes (Korthikanti et al. 2022's
               formula for GPT, models/gpt2.py), or with recompute (per-layer checkpointing)
               each layer's input only: token ids into the first, a boundary tensor into the rest.
  recompute    with recompute, one layer's activations while a backward recomputes it (the
               largest layer of the rank's stages): on a GPU part of the allocator's peak.
  receive      buffers posted ahead for incoming activations and gradients: (lookahead + 1)
               per direction and stage on the rank, each one microbatch's stage-boundary tensor.
  grad copies  gradient copies the step makes beside the gradients themselves (review F9):
               under data-parallel replicas the reducer flattens each stage's gradients into new
               buffers in parallel.reduce_dtype at its REDUCE_GRAD and holds them to the step's end
               (runtime/grad_reduce.py: +1x the stage's gradients during the drain), and
               GradSync.sync sums the gradients of weights held on several ranks (a tied
               embedding and head on different ranks, DualPipe's mirrored chunks) in their
               flattened concatenation, whose parts become the gradients (runtime/sync.py: +1x
               those gradients; after the pipeline, or without dp and tp from the holding stage's
               last weight gradient on, beside the activations then alive: GradSync.early).
  loss grad    the loss's backward on the last stage: a causal LM's cross-entropy allocates the fp32
               gradients of its log-softmax's output and input (8 bytes x vocab per token) at once.
  loss, tp     under tensor parallel the loss is vocab-parallel (parallel/loss_parallel.py): each tp
               rank keeps, and its backward allocates, V/tp of every token's logits (`loss_rank_bytes`).
  margin       a fraction of the above for allocator fragmentation and workspaces.
  overhead     a fixed amount per GPU outside the caching allocator: the CUDA context and NCCL's
               buffers (plan.gpu_overhead_gb; 0 for CPU ranks). An allocator peak never sees it.

Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from pipetrain.schedules.ir import Op
from pipetrain.schedules.simulate import TimedStep

GB = 1e9


def gb_text(nbytes: float) -> str:
    """Bytes as GB with a tenth of a GB's precision where that shows anything (3.1), else two
    significant digits without an exponent (0.0031): an OOM of a small model still says by how much."""
    gb = nbytes / GB
    if abs(gb) >= 0.1:
        return f"{gb:.1f}"
    digits = 1 - math.floor(math.log10(abs(gb))) if gb else 1
    return f"{gb:.{digits}f}"


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter that live for the whole run."""

    param: float = 4.0  # the stored weights
    grad: float = 4.0  # gradients, accumulated over microbatches in fp32
    master: float = 0.0  # an fp32 master copy when the weights are stored in 16 bits
    optim: float = 8.0  # AdamW's two fp32 moments

    @classmethod
    def adamw(cls, param_dtype: str = "fp32") -> "StateBytes":
        """fp32 weights (pipetrain's trainer, bf16 autocast included): 16 B/param; bf16 weights with
        an fp32 master copy (Megatron's mixed precision): 18 B/param."""
        if param_dtype not in ("fp32", "bf16"):
            raise ValueError(f"param dtype must be fp32 or bf16 (got {param_dtype!r})")
        return cls() if param_dtype == "fp32" else cls(param=2.0, master=4.0)

    @property
    def total(self) -> float:
        return self.param + self.grad + self.master + self.optim


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted peak, in bytes, by part."""

    rank: int
    states: float
    activations: float  # what the forwards keep for the backwards, at the simulated peak
    receive: float
    margin: float
    # under activation recompute, one layer's activations while a backward pass recomputes it: on a
    # GPU part of the allocator's peak; a CPU run's measured peak (the bytes forwards keep, plus
    # states) does not see it
    recompute: float = 0.0
    # the data-parallel reducer's flat copies and the tied / mirrored weights' sync copies, at their
    # worst moment over the activations' peak (`grad_copy_peak`); allocator memory a CPU run's count misses
    grad_copies: float = 0.0
    # the loss's backward on the last stage's rank: the fp32 gradients of the log-softmax's output and
    # input (a causal LM: 8 bytes x vocab per token), alive at once beside what the forward saved; on
    # an H200 llama3.2-1b's zbv run at 4 x 2048 tokens peaked 8.2 GB over the prediction without it
    loss_grad: float = 0.0
    overhead: float = 0.0  # CUDA context and NCCL buffers: outside the allocator, not under the margin

    @property
    def total(self) -> float:
        return self.allocated + self.overhead

    @property
    def allocated(self) -> float:
        """What the CUDA caching allocator's peak can see: the total without the fixed per-GPU overhead."""
        return (self.states + self.activations + self.recompute + self.grad_copies + self.loss_grad + self.receive
                + self.margin)

    @property
    def counted(self) -> float:
        """The total without what a CPU run's count misses (the recompute part, the gradient copies, the
        loss's backward, their share of the margin, the per-GPU overhead): what a CPU run counts."""
        base = self.allocated - self.margin
        unseen = self.recompute + self.grad_copies + self.loss_grad
        return self.allocated - unseen * (1.0 + self.margin / base) if base > 0 else self.allocated

    def to_json(self) -> dict[str, float]:
        return {"rank": self.rank, "states_gb": self.states / GB, "activations_gb": self.activations / GB,
                "recompute_gb": self.recompute / GB, "grad_copies_gb": self.grad_copies / GB,
                "loss_grad_gb": self.loss_grad / GB,
                "receive_gb": self.receive / GB, "margin_gb": self.margin / GB, "overhead_gb": self.overhead / GB,
                "total_gb": self.total / GB}


def peak_activation_bytes(row: Sequence[TimedStep], act_bytes: Mapping[int, float],
                          w_keep: Union[float, Mapping[int, float]] = 1.0,
                          held: Optional[Mapping[int, float]] = None) -> float:
    """Most activation bytes alive at once on one rank's simulated timeline.

    `act_bytes[stage]`: what one microbatch's F on that stage keeps; `w_keep`: the share B keeps
    for W, one for all stages or per stage. Frees come before allocations at equal times (a W
    ending as the next F starts leaves room for it). `held[stage]`: bytes allocated when the
    stage's last weight gradient (W or BW) on the rank ends and held to the step's end (the
    data-parallel reducer's flat copies, issued at the stage's REDUCE_GRAD), counted in the peak.
    """
    keeps = w_keep if isinstance(w_keep, Mapping) else {s: w_keep for s in act_bytes}
    if not all(0.0 <= k <= 1.0 for k in keeps.values()):
        raise ValueError(f"w_keep must be in [0, 1] (got {w_keep})")
    events: list[tuple[float, float]] = []
    last_grad: dict[int, float] = {}
    for ts in row:
        for a in ts.step.parts():
            size, w_keep = act_bytes[a.stage], keeps[a.stage]
            if a.op is Op.F:
                events.append((ts.start, size))
            elif a.op is Op.B:
                events.append((ts.end, -(1.0 - w_keep) * size))
            elif a.op is Op.W:
                events.append((ts.end, -w_keep * size))
            else:
                events.append((ts.end, -size))
            if a.op in (Op.W, Op.BW):
                last_grad[a.stage] = max(last_grad.get(a.stage, ts.end), ts.end)
    events += [(t, (held or {}).get(s, 0.0)) for s, t in last_grad.items()]
    events.sort()
    live = peak = 0.0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def loss_rank_bytes(per_token: float, *, tokens: int, tp: int) -> float:
    """What the loss keeps for its backward (or the backward allocates) on one tp rank for `tokens`
    tokens, from its whole-vocabulary bytes per token: 1/tp of them, the vocab-parallel cross-entropy
    holding V/tp logits per token on each tp rank (its (N,) int64 targets, 8 of the bytes, are whole:
    a 1/tp share of them is left out, 8 B against 4 x V/tp)."""
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1 (got {tp})")
    return per_token * tokens / tp


def rank_memory(
    rank: int, *, params: float, state: StateBytes, shard: int, activations: float, boundary_bytes: float,
    stages: int, lookahead: int, margin: float, expert_params: float = 0.0, expert_shard: int = 1,
) -> RankMemory:
    """Peak bytes of one rank: `params` stored on it (all its stages), `activations` from
    `peak_activation_bytes`, `boundary_bytes` one microbatch's stage input. Of `params`, `expert_params`
    (expert parallel: the rank's 1/ep of the experts) are sharded over `expert_shard` ranks (the
    expert-data-parallel group, dp / ep), the rest over `shard`."""
    if shard < 1 or expert_shard < 1:
        raise ValueError(f"shard degrees must be >= 1 (got {shard}, {expert_shard})")
    states = (params - expert_params) * state.total / shard + expert_params * state.total / expert_shard
    receive = 2 * (lookahead + 1) * stages * boundary_bytes
    return RankMemory(rank, states, activations, receive, margin * (states + activations + receive))


def sync_copy_bytes(held_by: Mapping[str, tuple[Sequence[int], float]], rank: int) -> float:
    """The most bytes GradSync.sync (runtime/sync.py) allocates at once on `rank`. `held_by[name]`:
    the rank of every stage holding a copy of weight `name` (a rank listed twice holds two copies),
    and its gradient's bytes on one rank. Weights whose copies all sit on this rank are summed one
    at a time into one new tensor (1x the largest); for each set of ranks that share copies, the
    flattened concatenation of its weights' gradients (a weight with one copy here goes in as it is
    and takes its part of the reduced buffer back as its gradient; one with two copies here is summed
    into a new tensor first), set after set: the largest set's bytes on this rank, plus the sums."""
    sets: dict[tuple[int, ...], float] = {}
    local = 0.0
    for ranks, nbytes in held_by.values():
        key = tuple(sorted(set(ranks)))
        if rank not in key:
            continue
        here = list(ranks).count(rank)
        if len(key) > 1:
            sets[key] = sets.get(key, 0.0) + nbytes * (2.0 if here > 1 else 1.0)
        elif here > 1:
            local = max(local, nbytes)
    return max(max(sets.values(), default=0.0), local)
