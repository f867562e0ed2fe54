"""Document masks vs causal attention at equal length (issue #46): what block-causal attention costs.

One llama-tiny-sized attention layer (models/llama.py Attention: hidden 128, 4 query heads, 2 key/value
heads, head_dim 32, RoPE), forward + backward of a (B, T, C) input, at T = 512 and 2048:

  causal      SDPA is_causal (what every run without document masks does)
  documents   SDPA with the (B, 1, T, T) block-causal mask and RoPE at positions within each document
              (runtime/documents.py), packed rows of documents whose lengths are drawn around `--doc-mean`
  mask_ms     building the mask alone (once per stage forward and microbatch, not per layer)

Variants run interleaved, one timed repetition each per round, so drift on a shared machine hits every
variant alike; per variant the median over `--rounds` rounds after `--warmup` untimed ones.
`factor` = documents / causal, the price per attention layer.

Usage: python bench/document_mask.py [--seqs 512 2048] [--batch 2] [--rounds 15] [--doc-mean 256]
       [--device cpu|cuda] [--out bench/results/document_mask.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from pipetrain.models.llama import Attention, Rotary
from pipetrain.runtime.documents import Documents, block_causal, documents

EOS = 0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32  # conf/model/llama-tiny.yaml


def packed_ids(batch: int, seq: int, doc_mean: int, g: torch.Generator) -> torch.Tensor:
    """(B, T) rows of documents of 1..2*doc_mean tokens (uniform), each ending in EOS."""
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq:
            n = int(torch.randint(1, 2 * doc_mean, (1,), generator=g))
            row += [1] * (n - 1) + [EOS]
        rows.append(row[:seq])
    return torch.tensor(rows)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0)


def step(attn: Attention, x: torch.Tensor, grad: torch.Tensor, docs: Optional[Documents]) -> None:
    attn.zero_grad(set_to_none=True)
    x.grad = None
    attn(x, docs).backward(grad)


def bench_seq(seq: int, args: argparse.Namespace, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(seq)
    attn = Attention(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, attention_bias=False,
                     qkv_bias=False, qk_norm=False, eps=1e-5, rotary=Rotary(HEAD_DIM, 10000.0, None)).to(device)
    x = torch.randn(args.batch, seq, HIDDEN, generator=g).to(device).requires_grad_(True)  # (B, T, C)
    grad = torch.randn(args.batch, seq, HIDDEN, generator=g).to(device)
    ids = packed_ids(args.batch, seq, args.doc_mean, g)
    host = documents(ids, EOS)
    docs = Documents(host.index.to(device), host.positions.to(device)).with_mask()  # (B, 1, T, T) built once
    variants: dict[str, Callable[[], None]] = {
        "causal": lambda: step(attn, x, grad, None),
        "documents": lambda: step(attn, x, grad, docs),
        "mask": lambda: block_causal(docs.index),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.warmup + args.rounds):
        for name, fn in variants.items():
            ms = timed(fn, device)
            if r >= args.warmup:
                times[name].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seq": seq, "batch": args.batch, "documents_per_row": float(host.index[:, -1].float().mean() + 1),
            "causal_ms": med["causal"], "documents_ms": med["documents"], "mask_ms": med["mask"],
            "factor": med["documents"] / med["causal"],
            "runs_ms": {k: [round(t, 3) for t in v] for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--doc-mean", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench/results/document_mask.json")
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    for seq in args.seqs:
        rows.append(bench_seq(seq, args, device))
        r = rows[-1]
        print(f"T={seq:5d}  causal {r['causal_ms']:8.2f} ms  documents {r['documents_ms']:8.2f} ms  "
              f"x{r['factor']:.2f}  (mask build {r['mask_ms']:.2f} ms, {r['documents_per_row']:.1f} documents a row)")
    result = {"bench": "document_mask", "what": "one llama-tiny attention layer, forward + backward",
              "device": args.device if device.type != "cuda" else torch.cuda.get_device_name(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "rounds": args.rounds, "warmup": args.warmup,
              "doc_mean": args.doc_mean, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
