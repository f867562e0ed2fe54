"""Schema of the `parallel` config group: data and tensor parallel around the pipeline (pure: no torch).

world = pipeline.degree x parallel.dp_replicate x parallel.dp_shard x parallel.cp x parallel.tp, one
DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp") with pp outermost and tp innermost
(pipetrain/parallel/layout.py).

  dp_replicate  full replicas of every stage; a stage's gradients are all-reduced once per
                step (one bucketed all-reduce, issued right after its last backward).
  dp_shard      FSDP2 `fully_shard` over this many ranks: parameters, gradients and optimizer
                state sharded; gradients reduce-scattered once per step. -1: fill the world
                (torchrun / SLURM, where the world is known before the ranks start).
  both > 1      HSDP: shard within a group of dp_shard ranks, replicate across dp_replicate groups.

  tp            tensor parallel (Megatron-LM, Shoeybi et al. 2019) inside every stage: attention
                heads and MLP columns split across tp ranks (column-parallel q/k/v and MLP
                in-projections, row-parallel out-projections), embedding and head split on the
                vocabulary; each tp rank of a stage sends its activations to the same tp index of
                the next stage. tp must divide the heads, kv heads, MLP width and vocabulary.
  ep            expert parallel: each MoE layer's experts split across this many ranks, folded over
                the dense ranks (Megatron-Core's "MoE parallel folding", torchtitan's rule: the world
                is unchanged): ep borrows the innermost ranks of dp_shard x cp (cp first), and of tp
                too where etp=1; it must divide the expert count. Tokens go to their experts' ranks
                and back by all-to-all; experts are FSDP2-sharded over the ranks holding the same
                ones (edp = dp_shard x cp x tp / (ep x etp), times dp_replicate).
  etp           expert tensor parallel: 1 (each expert whole on its rank; ep then takes whole tp
                groups, each tp rank dispatching 1/tp of the tokens they share) or tp (each expert's
                weights split over the tp group, column then row as the dense MLP); null: tp. Not
                with sequence parallel on an MoE model yet.
  cp            context parallel (parallel/cp.py): each sequence's positions split across this many
                ranks, load-balanced for causal attention (rank r: chunks r and 2cp-1-r of 2cp);
                attention reaches the others' keys and values by `cp_rotate`: allgather (K/V
                gathered) or ring (K/V blocks passed around, none held whole). Parameters are
                FSDP2-sharded over dp_shard x cp. With tp each tp rank's cp group passes its own
                heads' K/V (sequence parallel then splits a cp rank's positions: data.seq_len a
                multiple of cp x lcm(2, tp)). Llama family (MoE too: each cp rank routes its own
                positions; the balance counts are summed over the cp group), full causal attention.
  sequence_parallel  (Korthikanti et al. 2022) between the tensor-parallel regions, activations,
                norms and dropout are split on the sequence: (batch, seq / tp, hidden) per tp rank,
                also what crosses between stages. Needs tp > 1 and data.seq_len divisible by tp.

`overlap_reduce` (Megatron's --overlap-grad-reduce): true reduces each stage right after its
last weight gradient, overlapping the pipeline's drain; false reduces every stage at the end of
the step (schedules/reduce.py: add_reduces).

`param_dtype` is the dtype FSDP2 all-gathers parameters in and computes with (None: follow
trainer.precision); `reduce_dtype` the dtype gradients are reduced in. Gradients are always
accumulated over microbatches in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pipetrain.parallel.layout import fold_error

DTYPES = ("float32", "bfloat16")
CP_ROTATE = ("allgather", "ring")


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # data-parallel replicas of the pipeline (gradients all-reduced)
    dp_shard: int = 1  # -1: world / (pipeline.degree x dp_replicate)
    param_dtype: Optional[str] = None  # float32 | bfloat16; None: bfloat16 under trainer.precision=bf16
    reduce_dtype: str = "float32"  # float32 | bfloat16
    overlap_reduce: bool = True  # false: every stage's reduction at the end of the step
    tp: int = 1  # tensor-parallel degree: each stage's layers split across this many ranks (innermost)
    sequence_parallel: bool = False  # tp > 1: norms, dropout and stage-to-stage tensors split on the sequence
    ep: int = 1  # expert-parallel degree: MoE experts split across this many of dp_shard's ranks
    cp: int = 1  # context-parallel degree: each sequence's positions split across this many ranks
    etp: Optional[int] = None  # expert tensor-parallel degree: 1 or tp (null: tp); experts fold over the ranks
    cp_rotate: str = "allgather"  # how attention reaches the other positions' K/V: allgather | ring

    def __post_init__(self) -> None:
        if self.dp_replicate < 1:
            raise ValueError(f"parallel.dp_replicate must be >= 1 (got {self.dp_replicate})")
        if self.tp < 1:
            raise ValueError(f"parallel.tp must be >= 1 (got {self.tp})")
        for knob in ("ep", "cp", "etp"):
            if getattr(self, knob) is not None and getattr(self, knob) < 1:
                raise ValueError(f"parallel.{knob} must be >= 1 (got {getattr(self, knob)})")
        if self.cp_rotate not in CP_ROTATE:
            raise ValueError(f"parallel.cp_rotate={self.cp_rotate!r} is unknown: choose one of {', '.join(CP_ROTATE)}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true splits tensor-parallel activations on the sequence: "
                             "set parallel.tp > 1 or drop it")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"parallel.dp_shard must be >= 1, or -1 to fill the world (got {self.dp_shard})")
        for knob in ("param_dtype", "reduce_dtype"):
            value = getattr(self, knob)
            if value is not None and value not in DTYPES:
                raise ValueError(f"parallel.{knob}={value!r} is unknown: choose one of {', '.join(DTYPES)}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def fill_dp_shard(parallel: ParallelConfig, *, degree: int, world: Optional[int], where: str) -> int:
    """The dp_shard that -1 stands for: world / (pipeline.degree x dp_replicate x tp)."""
    if world is None:
        raise ValueError(
            f"parallel.dp_shard=-1 fills the world, but {where} does not fix the world size: "
            f"set parallel.dp_shard to a number"
        )
    other = degree * parallel.dp_replicate * parallel.cp * parallel.tp
    if world % other:
        tp = "".join(f" x parallel.{k}={getattr(parallel, k)}" for k in ("cp", "tp") if getattr(parallel, k) > 1)
        raise ValueError(
            f"parallel.dp_shard=-1: the world of {world} ranks is not a multiple of pipeline.degree={degree} x "
            f"parallel.dp_replicate={parallel.dp_replicate}{tp} = {other}: change one of them"
        )
    return world // other


def check_experts(par: ParallelConfig, num_experts: Optional[int], *, model: str) -> None:
    """parallel.ep and parallel.etp against the model and the dense degrees (the folding rules of
    parallel/layout.py: fold_error), one line naming the knob."""
    if num_experts is None:
        raise ValueError(f"parallel.ep={par.ep} / parallel.etp splits MoE experts but model={model} has none: set "
                         f"parallel.ep=1 and drop parallel.etp, or choose an MoE model (model=moe-tiny)")
    etp = par.tp if par.etp is None else par.etp
    error = fold_error(dp_shard=par.dp_shard, cp=par.cp, tp=par.tp, ep=par.ep, etp=etp)
    if error:
        raise ValueError(error)
    if num_experts % par.ep:
        raise ValueError(f"parallel.ep={par.ep} must divide model.moe.num_experts={num_experts}: set parallel.ep "
                         f"to a divisor of {num_experts}")
    if par.tp > 1 and par.sequence_parallel and etp != 1:
        raise ValueError(f"parallel.sequence_parallel with an MoE model needs parallel.etp=1 (experts whole, each tp "
                         f"rank dispatching its own 1/tp of the positions): at etp={etp} the experts' tp region would "
                         f"need the tokens gathered, which is not built: set parallel.etp=1 (and parallel.ep a "
                         f"multiple of {par.tp}) or drop sequence_parallel")


def launched_world(cluster_name: str) -> Optional[int]:
    """The world size a launcher outside pipetrain already fixed (torchrun), else None."""
    if cluster_name == "torchrun" and os.environ.get("WORLD_SIZE", "").isdigit():
        return int(os.environ["WORLD_SIZE"])
    return None


def world_text(degree: int, dp_replicate: int, dp_shard: int, cp: int = 1, tp: int = 1) -> str:
    """How error messages name the world: `the world of 8 ranks (pipeline.degree=2 x parallel.dp_shard=4)`."""
    if dp_replicate == dp_shard == cp == tp == 1:
        return f"pipeline.degree={degree}"
    parts = [f"pipeline.degree={degree}"]
    parts += [f"parallel.{k}={v}" for k, v in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("cp", cp),
                                              ("tp", tp)) if v > 1]
    return f"the world of {degree * dp_replicate * dp_shard * cp * tp} ranks ({' x '.join(parts)})"
