"""Activation recompute modes side by side: trainer.recompute=none, full and selective (issue 49).

For llama-tiny, moe-tiny and deepseek-tiny at P = 2 (one spawn of 2 gloo ranks per model), three trainers
(one per mode, same seed and data) are built side by side in one process group. After one untimed step each,
`--rounds` interleaved rounds measure one step of each in turn, each mode first in turn (the machine's load
falls on all three alike).
Per model and mode (medians over the rounds):

  step_ms                 the measured step (makespan on the common time axis, metrics/measure.py)
  activation_bytes        the measured peak of autograd's saved bytes per rank (the run's memory metrics:
                          the executor's saved-tensor accounting, runtime/step_result.py)
  predicted_bytes         the planner's activations per rank for the same run (planner/predict.py: the
                          layers' LayerCost, selective's modules in LayerCost.recompute_modules)
  loss                    the step's loss (every mode trains the same numbers: equal within float noise)
Per model: each mode's peak activations and step time over none's.

Usage: python bench/recompute_modes.py [--rounds 3] [--out bench/results/recompute_modes.json]
Under 3 minutes with --rounds 3 on 2 cores; timings only mean something on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from pipetrain.compose import compose_config
from pipetrain.launch.local import spawn_local
from pipetrain.plan import make_plan
from pipetrain.planner.memory import GB
from pipetrain.planner.predict import predict

RANKS = 2
BASE = ["mode=train", "data=synthetic", "data.seq_len=64", "data.batch_size=8", "pipeline.microbatches=4",
        f"pipeline.degree={RANKS}", "schedule=1f1b", "trainer.device=cpu", "trainer.eval_every=0",
        "trainer.ckpt_at_end=false", "trainer.ckpt_every=0", "logger=[]"]
MODES = ("none", "full", "selective")
REPO = Path(__file__).resolve().parent.parent


def configs(model: str) -> dict:
    return {mode: compose_config([*BASE, f"model={model}", f"trainer.recompute={mode}"]) for mode in MODES}


def rank_main(rank: int, world: int, out: Path, cases: dict, rounds: int) -> None:
    from pipetrain.train.trainer import Trainer

    trainers = {mode: Trainer(config, plan, out / mode) for mode, (config, plan) in cases.items()}
    for t in trainers.values():  # the first step's warm-up (allocator, graph analysis caches), untimed
        t.train_step()
    rows: dict[str, list] = {mode: [] for mode in trainers}
    names = list(trainers)
    for i in range(rounds):
        for mode in names[i % len(names):] + names[:i % len(names)]:  # each mode first in turn: no place favoured
            record = trainers[mode].train_step(measure=True)
            m = record.measurement
            if m is not None:
                rows[mode].append({"step_ms": m.makespan_ms, "loss": record.loss,
                                   "activation_bytes": [s.peak_activation_bytes for s in m.samples]})
    if rank == 0:
        torch.save(rows, out / "rows.pt")


def bench(model: str, rounds: int, root: Path) -> dict:
    cfgs = configs(model)
    plans = {mode: make_plan(c) for mode, c in cfgs.items()}
    work = root / model
    spawn_local(rank_main, RANKS, work, {mode: (cfgs[mode], plans[mode]) for mode in cfgs}, rounds)
    rows = torch.load(work / "rows.pt")
    modes = {}
    for mode, got in rows.items():
        predicted = [round(r["activations_gb"] * GB) for r in predict(cfgs[mode])["memory_per_rank"]]
        modes[mode] = {"step_ms": round(statistics.median(r["step_ms"] for r in got), 3),
                       "activation_bytes": [int(statistics.median(r["activation_bytes"][k] for r in got))
                                            for k in range(RANKS)],
                       "predicted_bytes": predicted, "loss": round(got[-1]["loss"], 6)}
    none = modes["none"]
    over = {mode: {"peak_activations": round(max(m["activation_bytes"]) / max(none["activation_bytes"]), 3),
                   "step_ms": round(m["step_ms"] / none["step_ms"], 3)} for mode, m in modes.items()}
    return {"model": model, "P": RANKS, "rounds": rounds, "modes": modes, "over_none": over}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["llama-tiny", "moe-tiny", "deepseek-tiny"])
    ap.add_argument("--out", default="bench/results/recompute_modes.json", help="relative to the repository")
    args = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:  # each row written as it comes: a failing model leaves the ones before it
            rows.append(row := bench(model, args.rounds, Path(tmp)))
            write(args.out, rows)
            print(f"{model:14s} " + "  ".join(f"{mode}: peak act x{o['peak_activations']:.3f}, step x{o['step_ms']:.3f}"
                                              for mode, o in row["over_none"].items()))


def write(out: str, rows: list[dict]) -> None:
    """The JSON under the repository (`out` relative to it), naming the script by its repository path."""
    path = REPO / out
    doc = {"bench": "recompute_modes", "script": str(Path(__file__).resolve().relative_to(REPO)),
           "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "load_avg_1m": round(os.getloadavg()[0], 2), "base": BASE, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
