"""Eager vs torch.compile (trainer.compile=true) step time of each pipeline stage, and the cost.

The model is cut into `--stages` stages as a pipeline run cuts it (partition=uniform), each
stage materialized alone on `--device` (weights from the seed, as every rank does). One
"stage step" is what a rank does per microbatch for that stage: forward of one microbatch of
`--microbatch` x `--seq` tokens (token ids into the first stage, a random (B, T, C) activation
into the others), then the backward of every input and weight gradient (the last stage's
cross-entropy; the others' a seeded random output gradient), as BW does. Per stage:

  eager_ms     median over `--steps` timed steps after `--warmup` untimed ones
  compile_s    the first compiled step (compilation included) minus one eager step
  compiled_ms  median, after the warm-up, with every layer compiled in place (nn.Module.compile,
               what trainer.compile=true does)
  tokens/s, and MFU where `--peak-tflops` is given or the GPU is known: training FLOPs per token
  3 x the cost model's forward FLOPs (F + B + W = 3 F, models/decoder_costs.py: layer_cost).

Usage: python bench/compile_stage.py [--model llama-tiny] [--stages 2] [--microbatch 4] [--seq 128]
       [--device cpu|cuda] [--precision fp32|bf16] [--layers N] [--out bench/results/compile_stage.json]
On CPU compilation is slow (tens of seconds per stage): keep the model small there. Inductor
caches compiled code across runs (/tmp/torchinductor_$USER): for the cold cost a fresh run
pays, give it an empty cache, TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/compile_stage.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pipetrain.compose import compose_config
from pipetrain.models.split import build_stage
from pipetrain.partition.strategies import partition
from pipetrain.plan import build_model

PEAK_TFLOPS = {"H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H200": 989.0, "A100": 312.0}  # dense bf16


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def stage_step(stage: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, grad: torch.Tensor | None,
               dtype: torch.dtype | None) -> None:
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out = stage(x)
    if stage.is_last:
        stage.loss(out.float(), target).backward()
    else:
        out.backward(grad.to(out.dtype))


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def bench_stage(stage, inputs, args, device, dtype) -> dict:
    step = lambda: stage_step(stage, *inputs, dtype)  # noqa: E731
    for _ in range(args.warmup):
        step()
    eager = [timed(step, device) for _ in range(args.steps)]
    for layer in stage.layers.values():
        layer.compile()
    first = timed(step, device)
    for _ in range(args.warmup):
        step()
    compiled = [timed(step, device) for _ in range(args.steps)]
    eager_ms, compiled_ms = statistics.median(eager), statistics.median(compiled)
    return {"eager_ms": round(eager_ms, 3), "compiled_ms": round(compiled_ms, 3),
            "speedup": round(eager_ms / compiled_ms, 3), "compile_s": round((first - eager_ms) / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--layers", type=int, default=None, help="override the block count (e.g. a 1B-shaped stage)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out", default="bench/results/compile_stage.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    device = torch.device(args.device)
    knob = {"llama": "num_hidden_layers", "gpt2": "n_layer"}
    over = [f"model={args.model}", f"data.seq_len={args.seq}", f"trainer.precision={args.precision}"]
    config = compose_config(over)
    if args.layers is not None:
        config = compose_config([*over, f"model.{knob[config.model.family]}={args.layers}"])
    model = build_model(config.model, device="meta")
    costs = model.cost_model(microbatch=args.microbatch, seq=args.seq, tflops=1.0)
    bounds = partition(costs, args.stages, "uniform").bounds
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    peak = peak_tflops(device, args.peak_tflops)
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()[0]  # timings on a shared machine: say how busy it was
    tokens = args.microbatch * args.seq
    rows = []
    for s, rng in enumerate(bounds):
        stage = build_stage(model, rng, stage_id=s, seed=0, device=device)
        ids, target = model.example_batch(microbatch=args.microbatch, seq=args.seq, generator=gen, device=device)
        spec = model.boundary_specs(microbatch=args.microbatch, seq=args.seq)
        x = ids if rng.start == 0 else torch.randn(spec[rng.start].shape, generator=gen).to(device).requires_grad_()
        grad = None if stage.is_last else torch.randn(spec[rng.stop].shape, generator=gen).to(device)
        row = {"stage": s, "layers": f"{rng.start}-{rng.stop - 1}", **bench_stage(stage, (x, target, grad), args,
                                                                                   device, dtype)}
        flops = 3 * sum(costs[i].flops_per_token for i in rng) * tokens
        for mode in ("eager", "compiled"):
            row[f"{mode}_tokens_per_s"] = round(tokens / (row[f"{mode}_ms"] / 1e3))
            if peak:
                row[f"{mode}_mfu"] = round(flops / (row[f"{mode}_ms"] / 1e3) / (peak * 1e12), 4)
        rows.append(row)
        print(json.dumps(row))
        del stage
    result = {"bench": "compile_stage", "model": args.model, "layers": args.layers, "stages": args.stages,
              "microbatch": args.microbatch, "seq": args.seq, "precision": args.precision, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "peak_tflops": peak, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "steps": args.steps, "warmup": args.warmup, "cpu_count": os.cpu_count(),
              # whether the inductor cache was a fresh one (cold compile) or torch's default (warm if run before)
              "inductor_cache_dir": ("fresh (cold)" if os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                                     else "default (warm if run before)"),
              "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "per_stage": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
