"""`schedule=auto` (or `plan.run=true`): plan, train the best row, and report the plan's own error.

Before any process starts: the plan group's search (planner/cmd.py) over the configured world
(`plan.world_size`, default the configured layout's) and global batch, its table and plan.json /
plan.csv in the run directory; the first feasible row becomes the run's layout, schedule,
microbatching, recompute and partition. After the run: summary.json gains the prediction next
to what was measured (median step time after the first step; the largest peak memory of any rank,
compared with the part of the prediction the run can measure: `measurable_peak_gb`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from pipetrain.config import AUTO, Config
from pipetrain.files import write_text_atomic
from pipetrain.planner.cmd import apply_row, assumptions, plan_rows, table, write
from pipetrain.metrics import names
from pipetrain.planner.memory import GB
from pipetrain.planner.search import Row


def wants_plan(config: Config) -> bool:
    return config.schedule.name == AUTO or config.plan.run


def choose(config: Config, run_dir: Path, console: Console) -> tuple[Config, Row]:
    """Plan and return the config that trains the best feasible row, and that row."""
    console.print(assumptions(config), markup=False, highlight=False)
    config, rows, meta = plan_rows(config, run_dir, console)
    write(rows, meta, run_dir)
    console.print(table(rows, top=min(config.plan.top, 5)))
    if not rows or not rows[0].feasible:
        if not any(r.memory for r in rows):
            raise ValueError(f"schedule=auto: no candidate was evaluated within plan.time_limit_s="
                             f"{config.plan.time_limit_s:g}: raise it or narrow the plan group's search space")
        raise ValueError(f"schedule=auto: no candidate fits plan.memory_gb={config.plan.memory_budget_gb:g} "
                         f"(closest: {rows[0].reason}): raise plan.memory_gb, allow plan.recompute=[false,true] or "
                         f"smaller plan.microbatch_sizes")
    best = rows[0]
    c = best.candidate
    recompute = {"no": "", "yes": ", recompute"}.get(c.recompute_label, f", recompute on {c.recompute_label}")
    console.print(f"plan: training row 1 of {meta['candidates']}: {c.layout}, {c.schedule} v={c.v}, "
                  f"M={c.microbatches}, microbatch {c.microbatch_size}{recompute}; predicted "
                  f"{best.pred_step_ms:.1f} ms/step, peak {best.pred_peak_gb:.3g} GB on rank {best.peak.rank}",
                  markup=False, highlight=False)
    return apply_row(config, best), best


def _error(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    return None if measured is None or not predicted else measured / predicted - 1.0


def measurable_peak_gb(row: Row, allocator_peak: bool) -> Optional[float]:
    """The row's predicted peak as the run measures it: where an allocator's peak is read (GPU), all
    but the fixed per-GPU overhead (the CUDA context and NCCL's buffers live outside the allocator);
    on CPU, where the run counts the bytes its forwards keep plus the states, without the one layer a
    backward recomputes at a time under activation recompute and the gradient copies (RankMemory.counted)."""
    if not row.memory:
        return None
    return max(m.allocated if allocator_peak else m.counted for m in row.memory) / GB


def report(row: Row, run_dir: Path, console: Console, *, allocator_peak: bool) -> Optional[dict[str, Any]]:
    """Add the prediction and its error to summary.json (atomically) and print them.
    `allocator_peak`: the ranks measured their peak memory with the CUDA allocator."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    measured_ms = summary[names.STEP_TIME] * 1e3 if summary.get(names.STEP_TIME) else None
    peaks = names.of_ranks(summary, names.PEAK_GB) or []  # GB per rank
    measured_gb = max(peaks) if peaks else None
    comparable_gb = measurable_peak_gb(row, allocator_peak)
    out = {"plan_pred_step_ms": row.pred_step_ms, "measured_step_ms": measured_ms,
           "step_time_error": _error(measured_ms, row.pred_step_ms),
           "plan_pred_peak_gb": row.pred_peak_gb, "plan_pred_peak_rank": row.peak.rank if row.peak else None,
           "plan_pred_measurable_peak_gb": comparable_gb,
           "measured_peak_gb": measured_gb, "peak_memory_error": _error(measured_gb, comparable_gb),
           "plan_row": row.to_json()}
    summary.update(out)
    write_text_atomic(path, json.dumps(summary, indent=2) + "\n")
    err = out["step_time_error"]
    line = f"plan vs run: step {row.pred_step_ms:.1f} ms predicted, " + (
        f"{measured_ms:.1f} ms measured ({100 * err:+.1f}%)" if measured_ms is not None else "not measured")
    if measured_gb is not None and comparable_gb is not None:
        unseen = "" if comparable_gb == row.pred_peak_gb else (
            f" (of {row.pred_peak_gb:.3g}: the allocator does not see plan.gpu_overhead_gb)" if allocator_peak else
            f" (of {row.pred_peak_gb:.3g}: a CPU run does not see the layer a backward recomputes "
            "or the gradient copies)")
        line += (f"; peak memory {comparable_gb:.3g} GB predicted{unseen}, {measured_gb:.3g} GB measured "
                 f"({100 * out['peak_memory_error']:+.1f}%)")
    console.print(line, markup=False, highlight=False)
    return out
