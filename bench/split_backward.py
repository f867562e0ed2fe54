"""Split backward cost: B + W time vs the fused full backward, on GPT-2 124M stages.

Zero-bubble schedules only pay off if splitting the backward costs (almost) nothing.
For three kinds of stage cut from the real GPT-2 124M model (first: embedding + block;
middle: two blocks; last: block + final norm + tied head + loss), run the forward, then
time either the fused backward (BW) or B followed by W, alternating so machine noise hits
both alike; report the median ratio (B + W) / BW. Target (issue 4): at most 1.10.

Usage: python bench/split_backward.py [--batch 2] [--seq 128] [--repeats 9] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

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
        inp, out, grad = forward()
        t0 = time.perf_counter()
        backward_full([out], [grad], [inp], params)
        return time.perf_counter() - t0

    def split() -> float:
        inp, out, grad = forward()
        t0 = time.perf_counter()
        _, work = backward_input([out], [grad], [inp], params)
        backward_weight(work)
        return time.perf_counter() - t0

    fused(), split()  # warm up allocator and kernels
    ratios, bw, bplusw = [], [], []
    for _ in range(repeats):
        a, b = fused(), split()
        bw.append(a * 1e3)
        bplusw.append(b * 1e3)
        ratios.append(b / a)
        stage.zero_grad(set_to_none=True)
    return {"bw_ms": round(statistics.median(bw), 2), "b_plus_w_ms": round(statistics.median(bplusw), 2),
            "ratio": round(statistics.median(ratios), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "split_backward.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2.from_preset("gpt2", dropout=0.0)
    rows = {}
    for name, layers in STAGES.items():
        rows[name] = time_stage(model, layers, batch=args.batch, seq=args.seq, repeats=args.repeats)
        r = rows[name]
        print(f"{name:>22}: BW {r['bw_ms']:8.1f} ms   B+W {r['b_plus_w_ms']:8.1f} ms   ratio {r['ratio']:.3f}", flush=True)
    worst = max(r["ratio"] for r in rows.values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gpt2 (124M)", "batch": args.batch, "seq": args.seq,
                               "threads": args.threads, "torch": torch.__version__, "worst_ratio": worst,
                               "target": 1.10, "stages": rows}, indent=2) + "\n")
    print(f"worst ratio {worst:.3f} (target <= 1.10); wrote {out}")


if __name__ == "__main__":
    main()
