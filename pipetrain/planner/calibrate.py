"""The planner's time model calibrated by one short run on this machine.

The simulator times a step from the model's per-layer costs alone; a real run adds what the
framework spends around them. bench/planner_accuracy.py measured the gap (sleep model, 4 CPU
ranks, metrics.jsonl of a pp x dp run against the plan): each F, B and W ran 0.5-0.7 ms per layer
longer than the layer's sleep (module call, autograd engine, hooks: mostly per layer, partly per
action), the measured makespan stayed within 1% of the simulated one with the
measured costs (point-to-point latency is small), the data-parallel reduce waited 7-14 ms after
the last backward where the bandwidth model says 0.1 ms (gloo's fixed cost per collective), and
the step took 10-20 ms longer than its makespan (loss reduce, grad norm, optimizer). So four
numbers, each a `plan` key:

  plan.action_overhead_ms  } a line fitted through (layers in the stage, measured - model ms) of
  plan.layer_overhead_ms   } every F, B and W: the cost per action and per layer
  plan.reduce_latency_ms   mean over ranks of measured - simulated exposed reduce (dp > 1 runs)
  plan.step_overhead_ms    median step time - median measured makespan with reduce

Pure Python: reads the rows of metrics.jsonl (logged every step) and summary.json's step time;
planner/measure.py trains the short runs (`plan.calibrate=true`) and hands them here.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from pipetrain.metrics import names

OPS = ("f_ms", "b_ms", "w_ms")


def _ranked(row: Mapping[str, Any], prefix: str) -> list[float]:
    """The per-rank values `prefix/rank<r>` of one metrics row, in pipeline order."""
    return [float(v) for v in names.of_ranks(row, prefix) or []]


def fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(per action, per layer) ms from (layers in the stage, measured - model ms of one action)
    samples: a line through the median excess at each stage size; one size -> all per layer."""
    by_n: dict[int, list[float]] = {}
    for n, e in samples:
        by_n.setdefault(n, []).append(e)
    if not by_n:
        raise ValueError("calibration: the run's metrics hold no per-stage F/B/W times (pipeline/stageN/f_ms)")
    pts = sorted((n, statistics.median(es)) for n, es in by_n.items())
    if len(pts) == 1:
        return 0.0, max(pts[0][1] / pts[0][0], 0.0)
    mn, me = statistics.fmean(n for n, _ in pts), statistics.fmean(e for _, e in pts)
    per_layer = sum((n - mn) * (e - me) for n, e in pts) / sum((n - mn) ** 2 for n, _ in pts)
    per_layer = max(per_layer, 0.0)
    return max(me - per_layer * mn, 0.0), per_layer


def excess(rows: Sequence[Mapping[str, Any]], *, model_ms: Mapping[str, Sequence[float]],
           layers: Sequence[int]) -> list[tuple[int, float]]:
    """(layers in the stage, measured - model ms) of every split op (F, B, W) of every stage and row.

    model_ms: per op ("f_ms", "b_ms", "w_ms") the model's time of each stage (sum of its layers');
    layers: the layers of each stage. Calibrate on a schedule that splits B and W (a BW-only stage
    reports its BW as b_ms, two ops' worth of layer overhead in one action)."""
    out = []
    for row in rows:
        for op in OPS:
            for s, (model, n) in enumerate(zip(model_ms.get(op, ()), layers)):
                key = f"pipeline/stage{s}/{op}"
                if key in row and model > 0 and row[key] > 0:
                    out.append((n, float(row[key]) - model))
    return out


def overheads(runs: Sequence[tuple[Sequence[Mapping[str, Any]], float, Sequence[int], Mapping[str, Sequence[float]]]]
              ) -> dict[str, float]:
    """The four `plan` overheads from short runs, each (metrics.jsonl rows of its measured steps
    without the first, warm-up step; its median step time; the layers of each stage; per op
    ("f_ms", "b_ms", "w_ms") the model's time of each stage, the sum of its layers' as the planner
    costs them). Two runs with different layers per stage separate the cost per action from the
    cost per layer."""
    samples, reduce, fixed = [], [], []
    for rows, step_ms, layers, model in runs:
        if not rows:
            raise ValueError("calibration needs at least one measured step after the first (trainer.log_every=1)")
        samples += excess(rows, model_ms=model, layers=layers)
        reduce += [statistics.fmean(m) - statistics.fmean(s) for row in rows
                   if (m := _ranked(row, "pipeline/reduce_exposed_ms"))
                   and (s := _ranked(row, "pipeline/reduce_exposed_simulated_ms"))]
        fixed.append(step_ms - statistics.median(
            float(r["pipeline/makespan_with_reduce_ms"] if "pipeline/makespan_with_reduce_ms" in r
              else r["pipeline/makespan_ms"]) for r in rows))
    per_action, per_layer = fit(samples)
    return {"action_overhead_ms": per_action, "layer_overhead_ms": per_layer,
            "reduce_latency_ms": max(statistics.median(reduce), 0.0) if reduce else 0.0,
            "step_overhead_ms": max(statistics.median(fixed), 0.0)}


def tp_latency(rows: Sequence[Mapping[str, Any]], *, model_f_ms: Sequence[float], layers: Sequence[int],
               collectives: Sequence[int], action_ms: float, layer_ms: float) -> float:
    """plan.tp_latency_ms from a tp > 1 run: per stage, its measured F beyond one tp rank's model F
    (compute / tp plus the collectives' bytes over the bandwidth), the action and the layers'
    overheads, shared by the F's TP collectives (`collectives` per stage); the median, >= 0."""
    out = [(float(row[key]) - model - action_ms - n * layer_ms) / k
           for row in rows for s, (model, n, k) in enumerate(zip(model_f_ms, layers, collectives))
           if k and (key := f"pipeline/stage{s}/f_ms") in row and row[key] > 0]
    if not out:
        raise ValueError("calibration: the tp run's metrics hold no per-stage F times (pipeline/stageN/f_ms)")
    return max(statistics.median(out), 0.0)
