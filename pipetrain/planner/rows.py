"""One scored candidate of a plan (`Row`): its prediction, memory and FLOP rates, and its plan.json record.
planner/search.py fills them. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipetrain.planner.memory import GB, RankMemory
from pipetrain.planner.space import Candidate
from pipetrain.schedules import registry


@dataclass
class Row:
    candidate: Candidate
    feasible: bool = False
    reason: str = ""
    pred_step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    bubble: Optional[float] = None
    exposed_comm_ms: Optional[float] = None
    memory: list[RankMemory] = field(default_factory=list)
    memory_budget: Optional[float] = None  # zb_auto: the smallest rank budget (microbatches)
    budgets: Optional[list[float]] = None  # zb_auto: every rank's budget (schedule.memory_budget)
    cut: tuple[tuple[int, int], ...] = ()  # the partition's layer range of each chunk, (start, stop)
    tflops_per_device: Optional[float] = None  # model FLOPs per second per device (6 x params + attention), TFLOP/s
    hw_tflops_per_device: Optional[float] = None  # FLOPs the devices execute (recompute included), TFLOP/s
    mfu: Optional[float] = None  # tflops_per_device over the device's peak
    links: str = ""  # plan.device: the groups whose collectives leave a node

    @property
    def peak(self) -> Optional[RankMemory]:
        return max(self.memory, key=lambda m: m.total) if self.memory else None

    @property
    def pred_peak_gb(self) -> Optional[float]:
        return self.peak.total / GB if self.memory else None

    def to_json(self) -> dict:
        c = self.candidate
        peak = self.peak
        return {
            "schedule": c.schedule, "pp": c.pp, "dp": c.dp, "tp": c.tp, "sequence_parallel": c.sequence_parallel,
            "ep": c.ep, "etp": c.expert_tp, "cp": c.cp,
            "v": c.v, "microbatches": c.microbatches, "microbatch_size": c.microbatch_size,
            "recompute": c.recompute, "recompute_ranks": c.recompute_ranks, "dp_shard": c.dp_shard,
            "recompute_stages": sorted(c.recompute_stages(registry.placement_for(c.schedule, c.pp, c.v))),
            "recompute_mode": c.recompute_mode,
            "recompute_per_stage": c.recompute_per_stage(registry.placement_for(c.schedule, c.pp, c.v)),
            "partition": c.partition, "layout": c.layout, "feasible": self.feasible, "reason": self.reason,
            "pred_step_ms": self.pred_step_ms, "tokens_per_s": self.tokens_per_s, "bubble": self.bubble,
            "pred_peak_gb": self.pred_peak_gb, "peak_rank": peak.rank if peak else None,
            "exposed_comm_ms": self.exposed_comm_ms, "memory_budget": self.memory_budget,
            "tflops_per_device": self.tflops_per_device, "hw_tflops_per_device": self.hw_tflops_per_device,
            "mfu": self.mfu, "across_nodes": self.links,
            "memory_per_rank": [m.to_json() for m in self.memory]}
