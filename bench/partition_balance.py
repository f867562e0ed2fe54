"""How evenly each partition strategy cuts GPT-2 124M into 4 and 8 stages.

Costs are the analytic cost model pipetrain's `mode=simulate` uses (one microbatch of
1 x 1024 tokens, FLOPs at sim.tflops), built through the same Config -> plan path as the
CLI. `profile` (measured, machine-dependent) and `manual` (the user's cut) are left out.
For each strategy: the cut, the imbalance (max/mean - 1) of estimated time (what bounds a
pipeline's throughput) and of parameters (what bounds its memory), and the slowest stage.

Writes JSON (default bench/results/partition_balance.json) and prints the table docs/benchmarks.md quotes.
Usage: python bench/partition_balance.py [--out FILE] [--model gpt2] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipetrain.config import (
    Config, DataConfig, GPT2ModelConfig, PartitionConfig, PipelineConfig, SimConfig,
)
from pipetrain.models.gpt2 import PRESETS
from pipetrain.plan import layer_costs, make_partition

STRATEGIES = ("uniform", "params", "flops", "balanced")
STAGES = (4, 8)


def config_for(model: str, stages: int, strategy: str, seq: int) -> Config:
    # Microbatch 1: data.batch_size = pipeline.microbatches (1F1B, 1 stage per rank).
    return Config(
        pipeline=PipelineConfig(degree=stages, microbatches=stages),
        model=GPT2ModelConfig(name=model, **PRESETS[model]),
        data=DataConfig(batch_size=stages, seq_len=seq),
        partition=PartitionConfig(strategy),
        sim=SimConfig(),
    )


def measure(model: str, stages: int, strategy: str, seq: int) -> dict:
    config = config_for(model, stages, strategy, seq)
    part = make_partition(config, layer_costs(config), config.num_chunks)
    ms = part.chunk_time_ms()
    return {
        "model": model, "stages": stages, "strategy": strategy, "balanced_on": part.balanced_on,
        "boundaries": list(part.boundaries),
        "params": list(part.chunk_params()),
        "est_ms": [round(x, 6) for x in ms],
        "time_imbalance": round(part.time_imbalance(), 6),
        "params_imbalance": round(part.imbalance("params"), 6),
        "slowest_stage_ms": round(max(ms), 6),
        "tflops": config.sim.tflops, "seq_len": seq, "microbatch": config.microbatch_size,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| stages | strategy | boundaries | time imbalance | params imbalance | slowest stage ms |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['stages']} | `{r['strategy']}` | {r['boundaries']} | "
                     f"{100 * r['time_imbalance']:.1f}% | {100 * r['params_imbalance']:.1f}% | "
                     f"{r['slowest_stage_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "partition_balance.json"))
    args = ap.parse_args()
    rows = [measure(args.model, k, s, args.seq) for k in STAGES for s in STRATEGIES]
    print(markdown(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
