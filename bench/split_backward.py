"""Split backward cost: B + W time vs the fused full backward, on GPT-2 124M stages.

Zero-bubble schedules only pay off if splitting the backward costs (almost) nothing.
For three kinds of stage cut from the real GPT-2 124M model (first: embedding + block;
middle: two blocks; last: block + final norm + tied head + loss), run the forward, then
time either the fused backward (BW) or B followed by W, alternating so machine noise hits
both alike; report the median ratio (B + W) / BW. Target (issue 4): at most 1.10.

On CPU the split keeps every recorded gradient alive until W, and glibc's malloc hands
large freed blocks back to the kernel, so B's fresh allocations page-fault where the fused
backward would reuse memory. That costs 10-20% on CPU and says nothing about the split
itself (GPUs use a caching allocator), so both are measured side by side: the default
allocator, and glibc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ / TRIM_THRESHOLD_,
what pipetrain's local launcher sets for CPU ranks).

Usage: python bench/split_backward.py [--batch 2] [--seq 128] [--repeats 9] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipetrain.launch.forkserver import CPU_MALLOC_ENV
from pipetrain.models.gpt2 import GPT2
from pipetrain.models.split import build_stage
from pipetrain.runtime.backward import backward_full, backward_input, backward_weight

STAGES = {"first (embed + h.0)": range(0, 2), "middle (h.4 + h.5)": range(5, 7), "last (h.11 + head)": range(12, 14)}


def time_stage(model: GPT2, layers: range, *, batch: int, seq: int, repeats: int) -> dict:
    stage = build_stage(model, layers, stage_id=0)
    params = [p for p in stage.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    idx, target = model.example_batch(microbatch=batch, seq=seq, generator=g)
    if layers.start == 0:
        x = idx
    else:  # the activation entering a middle or last stage: (B, T, C)
        with torch.no_grad():
            x = model.layers[0](idx)
            for i in range(1, layers.start):
                x = model.layers[i](x)

    def forward():
        inp = x.detach().requires_grad_(x.is_floating_point())
        out = stage(inp)
        if stage.is_last:
            return inp, stage.loss(out, target), None
        return inp, out, torch.randn_like(out)

    def fused() -> float:
        stage.zero_grad(set_to_none=True)  # both variants start from empty .grad (no accumulate)
        inp, out, grad = forward()
        t0 = time.perf_counter()
        backward_full([out], [grad], [inp], params)
        return time.perf_counter() - t0

    def split() -> float:
        stage.zero_grad(set_to_none=True)
        inp, out, grad = forward()
        t0 = time.perf_counter()
        _, work = backward_input([out], [grad], [inp], params)
        backward_weight(work)
        return time.perf_counter() - t0

    fused(), split()  # warm up allocator and kernels
    ratios, bw, bplusw = [], [], []
    for _ in range(repeats):
        b, a = split(), fused()
        bw.append(a * 1e3)
        bplusw.append(b * 1e3)
        ratios.append(b / a)
    return {"bw_ms": round(statistics.median(bw), 2), "b_plus_w_ms": round(statistics.median(bplusw), 2),
            "ratio": round(statistics.median(ratios), 4)}


KEEP_MEMORY = CPU_MALLOC_ENV


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2.from_preset("gpt2", dropout=0.0)
    return {name: time_stage(model, layers, batch=args.batch, seq=args.seq, repeats=args.repeats)
            for name, layers in STAGES.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "split_backward.json"))
    args = ap.parse_args()
    if args.child:  # one allocator setting, measured in this process
        print(json.dumps(measure(args)))
        return
    runs = {}
    for label, extra in (("default malloc", {}), ("malloc keeps freed memory", KEEP_MEMORY)):
        env = {k: v for k, v in os.environ.items() if k not in KEEP_MEMORY} | extra
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
        runs[label] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
        for name, r in runs[label].items():
            print(f"{label:>26} | {name:>20}: BW {r['bw_ms']:7.1f} ms  B+W {r['b_plus_w_ms']:7.1f} ms  "
                  f"ratio {r['ratio']:.3f}", flush=True)
    worst = {label: max(r["ratio"] for r in rows.values()) for label, rows in runs.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gpt2 (124M)", "batch": args.batch, "seq": args.seq,
                               "threads": args.threads, "torch": torch.__version__, "worst_ratio": worst,
                               "target": 1.10, "runs": runs}, indent=2) + "\n")
    print(f"worst ratio {worst} (target <= 1.10); wrote {out}")


if __name__ == "__main__":
    main()
