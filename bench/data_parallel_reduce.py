"""Exposed gradient-reduction time, measured vs simulated, and what overlapping it saves.

pp=2 x dp_replicate=2 (4 gloo ranks in one process group), the sleep model with 8 layers of
`--params` fp32 weights each (2 layers per stage: a stage's reduction moves tens of MB),
F = B = W = `--layer-ms` per layer, interleaved 1F1B with 2 stages per rank, M = 4. A rank's
later stage (2 or 3) runs its last backward two chunk-backwards before the rank's end: with
parallel.overlap_reduce=true its reduction runs while the rank drains the earlier stage
(Megatron's --overlap-grad-reduce); with false every reduction waits for the step's end.
(Under ZB-V and DualPipe-V at P=2 the later stage of rank 1 ends too late for much overlap.)
The per-microbatch work on the weights (a mean in F, the gradient accumulated in W) is real
compute on top of the sleeps; the simulation with measured op times includes it.

1. Calibrate: time an all-reduce of one stage's gradient bytes in the data-parallel groups of
   this process group (one group at a time, as the simulator's lane assumes; the slowest
   rank's median of repeats), and pass bytes-on-the-wire / time as cluster.dp_bandwidth_gbs,
   so the simulated lane runs at the speed gloo reaches here. Both groups at once is timed too.
2. Interleave rounds of overlap_reduce=true and false (order alternating per round); every
   step is measured (trainer.train_step(measure=True), the path a logged step takes) and the
   first step of each round is dropped.
3. Report per config the exposed reduce ms measured vs simulated (most of any rank; the
   simulation uses that step's measured op times and the calibrated bandwidth), the step's
   makespan with the exposed reduce measured vs simulated, and the ratio overlapped / at end.

Usage: python bench/data_parallel_reduce.py [--rounds 5] [--steps 5] [--params 3000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.compose import compose_config
from pipetrain.launch.local import spawn_local
from pipetrain.plan import make_plan
from pipetrain.schedules.reduce_cost import wire_bytes
from pipetrain.schedules.simulate import simulate

WORLD = 4
OVERLAP = ("true", "false")


def knobs(args: argparse.Namespace) -> list[str]:
    ms = args.layer_ms
    return ["mode=train", "model=sleep", "data=synthetic", "model.layers=8", f"model.f_ms={ms}", f"model.b_ms={ms}",
            f"model.w_ms={ms}", "model.hidden=64", f"model.params_per_layer={args.params}", "schedule=interleaved_1f1b",
            "schedule.virtual_stages=2",
            "pipeline.degree=2", "parallel.dp_replicate=2", "pipeline.microbatches=4", "data.batch_size=8",
            "trainer.device=cpu", "logger=[jsonl]", "trainer.eval_every=0", "trainer.ckpt_at_end=false"]


def _timed_all_reduces(buf: torch.Tensor, group, repeats: int, *, mine: bool) -> list[float]:
    """ms of each all-reduce of `buf` in `group` (every rank passes the barriers; only `mine` reduce)."""
    times = []
    for i in range(repeats + 1):  # the first one sets the connection up
        dist.barrier()
        if mine:
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    return times


def _slowest_median(times: list[float]) -> float:
    """The slowest rank's median (collective), so every rank agrees."""
    t = torch.tensor([statistics.median(times) if times else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def calibrate(args: argparse.Namespace, stage_params: int) -> dict:
    """Collective: all-reduce one stage's fp32 gradients in each dp group, one group at a time
    (the simulator's lane: one reduction on the wire, nothing else), and, for reference, in
    every dp group at once (as when all ranks reduce at the step's end)."""
    from pipetrain.parallel.mesh import build_groups

    layout = compose_config(knobs(args)).layout
    groups = build_groups(layout, "cpu")
    buf = torch.ones(stage_params)
    alone = []
    for p in range(layout.pp):
        alone += _timed_all_reduces(buf, groups.dp_group, args.calibrate, mine=groups.pp_rank == p)
    ms, together = _slowest_median(alone), _slowest_median(_timed_all_reduces(buf, groups.dp_group, args.calibrate,
                                                                              mine=True))
    moved = wire_bytes(4.0 * stage_params, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard)
    return {"stage_bytes": 4 * stage_params, "wire_bytes": moved, "all_reduce_ms": ms,
            "dp_bandwidth_gbs": moved / (ms / 1e3) / 1e9, "all_reduce_ms_all_groups_at_once": together}


def rank_main(rank: int, world: int, out: Path, args: argparse.Namespace) -> None:
    from pipetrain.train.trainer import Trainer

    plan = make_plan(compose_config(knobs(args)))
    calib = calibrate(args, plan.partition.chunk_params()[0])
    bw = f"cluster.dp_bandwidth_gbs={calib['dp_bandwidth_gbs']:.6g}"
    trainers = {}
    for ov in OVERLAP:
        config = compose_config([*knobs(args), f"parallel.overlap_reduce={ov}", bw])
        trainers[ov] = Trainer(config, make_plan(config), out / f"overlap_{ov}")
    rows = []
    for rnd in range(args.rounds):
        for ov in (OVERLAP if rnd % 2 == 0 else OVERLAP[::-1]):
            for i in range(args.steps):
                dist.barrier()
                record = trainers[ov].train_step(measure=True)
                if rank == 0 and i:  # the first step of a round warms the other config's trainer up
                    m = record.measurement  # the bench keeps its own field names (results/*.json)
                    rows.append({"overlap_reduce": ov == "true", "round": rnd, "step_time_s": record.step_time_s,
                                 "reduce_exposed_ms_per_rank": list(m.reduce_exposed_ms),
                                 "simulated_reduce_exposed_ms_per_rank": list(m.simulated.reduce_exposed_ms),
                                 "makespan_with_reduce_ms": m.measured.makespan_with_reduce,
                                 "simulated_makespan_with_reduce_ms": m.simulated.makespan_with_reduce,
                                 "makespan_ms": m.makespan_ms, "simulated_makespan_ms": m.simulated.makespan})
    if rank == 0:
        (out / "measured.json").write_text(json.dumps({"calibration": calib, "rows": rows}))


def median(rows: list[dict], key: str, reduce=lambda v: v) -> float:
    return round(statistics.median(reduce(r[key]) for r in rows), 3)


def summarize(args: argparse.Namespace, measured: dict) -> dict:
    calib, rows = measured["calibration"], measured["rows"]
    configs = {}
    for ov in OVERLAP:
        mine = [r for r in rows if r["overlap_reduce"] == (ov == "true")]
        config = compose_config([*knobs(args), f"parallel.overlap_reduce={ov}",
                                 f"cluster.dp_bandwidth_gbs={calib['dp_bandwidth_gbs']:.6g}"])
        plan = make_plan(config)
        configured = simulate(plan.schedule, plan.stage_costs, reduce_ms=plan.reduce_ms, check=False)
        configs[f"overlap_reduce={ov}"] = {
            "steps": len(mine),
            "reduce_ms_per_stage": [round(x, 3) for x in plan.reduce_ms or ()],
            "exposed_reduce_ms": {"measured": median(mine, "reduce_exposed_ms_per_rank", max),
                                  "simulated": median(mine, "simulated_reduce_exposed_ms_per_rank", max),
                                  "simulated_configured_costs": round(max(configured.reduce_exposed_ms), 3)},
            "exposed_reduce_ms_per_rank": {
                "measured": [round(statistics.median(r["reduce_exposed_ms_per_rank"][p] for r in mine), 3)
                             for p in range(2)],
                "simulated": [round(statistics.median(r["simulated_reduce_exposed_ms_per_rank"][p] for r in mine), 3)
                              for p in range(2)]},
            "makespan_with_reduce_ms": {"measured": median(mine, "makespan_with_reduce_ms"),
                                        "simulated": median(mine, "simulated_makespan_with_reduce_ms"),
                                        "simulated_configured_costs": round(configured.makespan_with_reduce, 3)},
            "makespan_ms": {"measured": median(mine, "makespan_ms"),
                            "simulated": median(mine, "simulated_makespan_ms")},
            "step_time_s": median(mine, "step_time_s"),
            "per_step": {"makespan_ms": [r["makespan_ms"] for r in mine],
                         "makespan_with_reduce_ms": [r["makespan_with_reduce_ms"] for r in mine],
                         "exposed_reduce_ms": [max(r["reduce_exposed_ms_per_rank"]) for r in mine]},
        }
    over, end = configs["overlap_reduce=true"], configs["overlap_reduce=false"]
    ratio = {k: round(over["makespan_with_reduce_ms"][k] / end["makespan_with_reduce_ms"][k], 4)
             for k in ("measured", "simulated", "simulated_configured_costs")}
    ratio["step_time_s"] = round(over["step_time_s"] / end["step_time_s"], 4)
    return {"configs": configs, "overlapped_over_at_end": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of overlap_reduce=true and false")
    ap.add_argument("--steps", type=int, default=5, help="steps per config per round (the first is dropped)")
    ap.add_argument("--layer-ms", type=float, default=6.0, help="F, B and W time of one sleep layer")
    ap.add_argument("--params", type=int, default=3_000_000, help="fp32 weights per sleep layer (2 layers per stage)")
    ap.add_argument("--calibrate", type=int, default=8, help="timed all-reduces for the bandwidth")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_parallel_reduce.json"))
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pipetrain-bench-") as tmp:
        spawn_local(rank_main, WORLD, Path(tmp), args)
        measured = json.loads((Path(tmp) / "measured.json").read_text())
    calib = measured["calibration"]
    result = {"setup": {"layout": "pp=2 x dp_replicate=2 (4 gloo ranks)", "model": "sleep, 8 layers",
                        "layer_ms": args.layer_ms, "params_per_layer": args.params,
                        "schedule": "interleaved_1f1b (v=2)",
                        "microbatches": 4, "rounds": args.rounds, "steps_per_round": args.steps},
              "machine": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]},
              "calibration": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in calib.items()},
              **summarize(args, measured)}
    for name, c in result["configs"].items():
        e, m = c["exposed_reduce_ms"], c["makespan_with_reduce_ms"]
        print(f"{name:22s} exposed reduce {e['measured']:7.2f} ms measured vs {e['simulated']:7.2f} simulated; "
              f"step {m['measured']:7.2f} ms measured vs {m['simulated']:7.2f} simulated")
    r = result["overlapped_over_at_end"]
    print(f"calibrated {calib['dp_bandwidth_gbs']:.3f} GB/s ({calib['all_reduce_ms']:.1f} ms per stage); "
          "overlapped / at end: "
          f"{r['measured']:.3f} measured, {r['simulated']:.3f} simulated, wall step {r['step_time_s']:.3f}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
