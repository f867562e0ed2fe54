"""The planner's search space: one `Candidate` per (pp x dp x cp x tp layout, ep folded over dp x cp (and tp
where etp = 1), schedule, v, M, microbatch size, recompute, partition strategy) that the `plan` group allows;
planner/search.py scores them.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from pipetrain.schedules import registry
from pipetrain.schedules.placement import Placement


@dataclass(frozen=True)
class Candidate:
    schedule: str
    pp: int
    dp: int
    v: int
    microbatches: int
    microbatch_size: int
    recompute: bool = False
    dp_shard: bool = False  # FSDP2 sharding over dp (else replicas)
    partition: str = "balanced"
    tp: int = 1  # tensor-parallel degree inside every stage (world = pp x dp x tp)
    sequence_parallel: bool = False  # tp > 1: activations and stage tensors split on the sequence
    recompute_ranks: Optional[int] = None  # with recompute: only the stages of pipeline ranks below this (None: all)
    ep: int = 1  # expert parallel: MoE experts split over ep of the dp ranks (FSDP2-sharded dp: dp_shard)
    cp: int = 1  # context parallel: every sequence split over cp ranks (world = pp x dp x cp x tp)
    selective: bool = False  # with recompute: trainer.recompute=selective (its modules only) instead of full
    etp: Optional[int] = None  # expert tensor parallel (parallel.etp): None = tp (experts split in width), or 1

    @property
    def expert_tp(self) -> int:
        """The ranks each expert's weights split over: tp, or 1 (experts whole, ep over the tp ranks too)."""
        return self.tp if self.etp is None else self.etp

    def recompute_stages(self, pl: Placement) -> frozenset[int]:
        """The stage ids that recompute."""
        if not self.recompute:
            return frozenset()
        ranks = range(self.pp if self.recompute_ranks is None else self.recompute_ranks)
        return frozenset(s for r in ranks for s in pl.stages_of(r))

    @property
    def recompute_mode(self) -> str:
        """trainer.recompute on the stages that recompute: none, full or selective."""
        return "none" if not self.recompute else "selective" if self.selective else "full"

    def recompute_per_stage(self, pl: Placement) -> list[str]:
        """Per stage id, its recompute mode (plan.json rows)."""
        on = self.recompute_stages(pl)
        return [self.recompute_mode if s in on else "none" for s in range(pl.num_stages)]

    @property
    def recompute_label(self) -> str:
        if not self.recompute:
            return "no"
        label = "selective" if self.selective else "yes"
        if self.recompute_ranks is None:
            return label
        where = "rank 0" if self.recompute_ranks == 1 else f"ranks 0-{self.recompute_ranks - 1}"
        return f"selective {where}" if self.selective else where

    @property
    def layout(self) -> str:
        tp = f" x tp{self.tp}" + (" (sp)" if self.sequence_parallel else "") if self.tp > 1 else ""
        cp = f" x cp{self.cp}" if self.cp > 1 else ""
        etp = ", etp1" if self.expert_tp < self.tp else ""
        ep = f" (ep{self.ep}{etp})" if self.ep > 1 else ""
        return f"pp{self.pp} x dp{self.dp}{ep}{cp}{tp}" + (" (fsdp)" if self.dp_shard and self.dp > 1 else "")



def candidates(*, world: int, global_batch: int, num_layers: int, schedules: Sequence[str],
               microbatch_sizes: Sequence[int], virtual_stages: Sequence[int], recompute: Sequence[bool] = (False,),
               recompute_partial: bool = False, recompute_selective: bool = False,
               pp_degrees: Optional[Sequence[int]] = None, dp_shard: bool = False,
               partitions: Sequence[str] = ("balanced",), max_microbatches: int = 256, tp_degrees: Sequence[int] = (1,),
               sequence_parallel: bool = False, ep_degrees: Sequence[int] = (1,),
               cp_degrees: Sequence[int] = (1,), experts_whole: bool = False) -> list[Candidate]:
    """Every valid combination: pp x dp x cp x tp = world, M = global_batch / (dp x microbatch size), each
    partition strategy; each ep dividing dp x cp (its rows FSDP2-sharded: expert parallel folds over
    dp_shard x cp at parallel.etp = tp, parallel/layout.py). `experts_whole` (an MoE model): where tp > 1, also
    rows at etp = 1, each ep a multiple of tp dividing dp x cp x tp (ep takes tp's ranks whole), and only those
    under sequence parallel (the run's rule). `recompute_partial`:
    where recompute is tried, also on the first k pipeline ranks only (1 <= k < pp);
    `recompute_selective`: each recompute row also with selective recompute."""
    out = []
    for cp, tp, pp in [(c, t, p) for c in cp_degrees for t in tp_degrees if world % (c * t) == 0
                       for p in (pp_degrees
                                 or [q for q in range(1, world // (c * t) + 1) if world // (c * t) % q == 0])]:
        if world % (pp * tp * cp):
            continue
        dp, sp = world // (pp * tp * cp), sequence_parallel and tp > 1
        # as parallel.ep folds at etp = tp (its default); sequence parallel with MoE runs at etp = 1 only
        folds = [] if experts_whole and sp else [(e, None) for e in ep_degrees if dp * cp % e == 0]
        if experts_whole and tp > 1:  # etp = 1: as parallel/layout.py fold_error allows
            folds += [(e, 1) for e in ep_degrees if e % tp == 0 and dp * cp * tp % e == 0]
        for ep, etp in folds:
            rows = _layout_rows(pp, dp, tp, sp, ep, cp, dp_shard or ep > 1, num_layers=num_layers, schedules=schedules,
                                global_batch=global_batch, microbatch_sizes=microbatch_sizes,
                                virtual_stages=virtual_stages, recompute=recompute, recompute_partial=recompute_partial,
                                partitions=partitions, max_microbatches=max_microbatches)
            out += rows if etp is None else [dataclasses.replace(c, etp=etp) for c in rows]
    if recompute_selective:
        out += [dataclasses.replace(c, selective=True) for c in out if c.recompute]
    return out


def _layout_rows(pp: int, dp: int, tp: int, sp: bool, ep: int, cp: int, dp_shard: bool, *, num_layers: int,
                 schedules: Sequence[str], global_batch: int, microbatch_sizes: Sequence[int],
                 virtual_stages: Sequence[int], recompute: Sequence[bool], recompute_partial: bool,
                 partitions: Sequence[str], max_microbatches: int) -> list[Candidate]:
    """One parallel layout's rows: each schedule, v, microbatch size, recompute and partition it allows."""
    out = []
    for name in (one_stage_schedules(schedules) if pp == 1 else schedules):
        spec = registry.get(name)
        for v in ([spec.fixed_stages_per_rank] if spec.fixed_stages_per_rank else virtual_stages):
            if pp * v > num_layers:
                continue
            for mbs in microbatch_sizes:
                if global_batch % (dp * mbs):
                    continue
                M = global_batch // (dp * mbs)
                if M > max_microbatches or not spec.is_valid(pp, M, v):
                    continue
                for rc, part in [(rc, part) for rc in recompute for part in partitions]:
                    out.append(Candidate(name, pp, dp, v, M, mbs, rc, dp_shard, part, tp, sp, None, ep, cp))
                    if rc and recompute_partial:
                        out.extend(Candidate(name, pp, dp, v, M, mbs, rc, dp_shard, part, tp, sp, k, ep, cp)
                                   for k in range(1, pp))
    return out


def why_empty(*, world: int, global_batch: int, num_layers: int, schedules: Sequence[str],
              microbatch_sizes: Sequence[int], virtual_stages: Sequence[int],
              pp_degrees: Optional[Sequence[int]] = None, max_microbatches: int = 256,
              tp_degrees: Sequence[int] = (1,), cp_degrees: Sequence[int] = (1,)) -> str:
    """Why `candidates` found nothing, the first of its filters that left no row, with the knob to change."""
    inner = [c * t for c in cp_degrees for t in tp_degrees if world % (c * t) == 0]  # cp x tp inside every pp x dp
    layouts = [(k, pp) for k in inner
               for pp in (pp_degrees or [q for q in range(1, world // k + 1) if world // k % q == 0])
               if world % (pp * k) == 0]
    if not inner:
        return (f"no cp x tp of plan.cp={list(cp_degrees)} and plan.tp={list(tp_degrees)} divides the world of {world} "
                f"ranks: list smaller degrees there, or make plan.world_size a multiple of one")
    if not layouts:
        fits = sorted({q for k in inner for q in range(1, world // k + 1) if world // k % q == 0})
        tp = f" x tp in plan.tp={list(tp_degrees)}" if list(tp_degrees) != [1] else ""
        cp = f" x cp in plan.cp={list(cp_degrees)}" if list(cp_degrees) != [1] else ""
        return (f"no pipeline degree in plan.pp={list(pp_degrees or [])} divides the world of {world} ranks (pp x dp"
                f"{cp}{tp} = world): list some of {', '.join(map(str, fits))} in plan.pp, or make plan.world_size a "
                f"multiple of a degree it lists")
    vs = [v for name in schedules for v in ([registry.get(name).fixed_stages_per_rank]
                                             if registry.get(name).fixed_stages_per_rank else virtual_stages)]
    staged = [(k, pp, v) for k, pp in layouts for v in set(vs) if pp * v <= num_layers]
    if not staged:
        fewest = min(pp * v for _, pp in layouts for v in vs)
        return (f"every layout cuts the model into more stages than its {num_layers} layers (the fewest: {fewest}): "
                f"lower plan.pp or plan.virtual_stages, or use a model with more layers")
    batches = [global_batch // (world // (pp * k) * mbs) for k, pp, _ in staged for mbs in microbatch_sizes
               if global_batch % (world // (pp * k) * mbs) == 0]
    if not batches:
        return ("make plan.global_batch a multiple of dp x a microbatch size in plan.microbatch_sizes, "
                "or widen plan.pp / plan.schedules")
    if min(batches) > max_microbatches:
        return (f"every row needs more than plan.max_microbatches={max_microbatches} microbatches (the fewest: "
                f"{min(batches)}): raise plan.max_microbatches or add larger plan.microbatch_sizes")
    return ("no schedule in plan.schedules runs the pp, M and v these give: widen plan.schedules, "
            "plan.microbatch_sizes or plan.global_batch")


def one_stage_schedules(schedules: Sequence[str]) -> list[str]:
    """The schedules worth a pp=1 row: on one rank every schedule is gradient accumulation over M
    microbatches (no bubble, no transfers), so one row says it, 1f1b's where listed (one microbatch's
    activations live; gpipe keeps all M). Splitting the model into v >= 2 stages on the one rank only
    adds actions, so those schedules are left out unless nothing else is listed."""
    single = [n for n in schedules if registry.get(n).fixed_stages_per_rank == 1]
    if not single:
        return list(schedules)
    # the fewest activations live: 1f1b's one microbatch, then any but gpipe (which keeps all M)
    return ["1f1b"] if "1f1b" in single else sorted(single, key=lambda n: n == "gpipe")[:1]
