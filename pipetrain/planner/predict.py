"""`python -m pipetrain.planner.predict <overrides>`: the planner's prediction for exactly the configured
run (its layout, schedule, microbatching, recompute and partition; no search), as one JSON line.

What bench/gpu_check.py compares a run's allocator peak with: `peak_gb` is the largest rank's
predicted peak as the CUDA caching allocator sees it (`RankMemory.allocated`: everything but
plan.gpu_overhead_gb, which lives outside the allocator); `total_gb` adds that overhead (what must
fit in the device); `memory_per_rank` splits each rank's into its parts. The prediction is made with
no memory cap, so a row that would not fit is still costed whole.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from pipetrain.config import Config
from pipetrain.planner.cmd import PARTITIONS, device, workload
from pipetrain.planner.memory import GB
from pipetrain.planner.search import _Evaluator
from pipetrain.planner.space import Candidate
from pipetrain.schedules import registry


def candidate(config: Config) -> Candidate:
    """The planner's candidate for the configured run."""
    s, p, par, lay = config.schedule, config.pipeline, config.parallel, config.layout
    if s.name not in registry.names():
        raise ValueError(f"schedule={s.name}: predict costs a built-in schedule: set one (not auto or custom)")
    v = registry.get(s.name).fixed_stages_per_rank or s.virtual_stages
    return Candidate(s.name, p.degree, lay.dp, v, p.microbatches, config.microbatch_size,
                     recompute=config.trainer.recompute != "none", selective=config.trainer.recompute == "selective",
                     dp_shard=lay.dp_shard > 1,
                     partition=PARTITIONS.get(config.partition.name, "balanced"), tp=par.tp,
                     sequence_parallel=par.sequence_parallel and par.tp > 1, ep=par.ep, cp=par.cp,
                     etp=lay.etp)


def predict(config: Config) -> dict[str, Any]:
    c = candidate(config)
    dev = dataclasses.replace(device(config), memory_gb=1e12)  # no cap: every part is costed
    row = _Evaluator(workload(config), dev).evaluate(c)
    peak = max(row.memory, key=lambda m: m.allocated)
    return {"peak_gb": peak.allocated / GB, "total_gb": row.pred_peak_gb, "rank": peak.rank,
            "fits_plan_memory_gb": row.pred_peak_gb <= config.plan.memory_budget_gb, "pred_step_ms": row.pred_step_ms,
            "gpu_overhead_gb": dev.gpu_overhead_gb, "memory_per_rank": [m.to_json() for m in row.memory],
            "candidate": dataclasses.asdict(c)}


def main(argv: list[str]) -> None:
    from pipetrain.compose import compose_config

    print(json.dumps(predict(compose_config(argv))))


if __name__ == "__main__":
    main(sys.argv[1:])
