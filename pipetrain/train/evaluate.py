"""mode=eval: the mean next-token loss of the model on a whole token file, or on data=datasets'
validation rows, on the pipeline ranks.

Windows (issue 13): with N tokens and T = data.seq_len, window i (i = 0, 1, ... while
i*T + T < N) holds tokens [i*T, i*T + T], inputs its first T and targets its last T, so
(N - 1) // T windows cover every token but the last partial window's. They are taken in order,
data.batch_size to a batch (split over dp pipelines x pipeline.microbatches as training
does); the last batch is padded with rows whose targets are -1, which the loss ignores and the
executor's evaluate() does not count, so the result is the exact mean over every target.

The model is the run's: the seeded initial weights, model.pretrained, or trainer.resume's
checkpoint. Rank 0 writes eval.json (loss, tokens, windows, file) in the run directory.

data=datasets: every validation row once, in order (data.val_split's documents, else the held-out last
data.val_fraction of the documents; each source's under data.sources), packed as training packs them and
read from the same tokenized cache (never streamed: data.streaming=true is refused), with document masks
where training has them (data.document_mask); padding targets (-1: packing=false's, a last batch's padded
rows) count in no loss, so the result is the mean over every counted target. eval.json says `rows`.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipetrain.config import Config
from pipetrain.config.data import DataConfig
from pipetrain.metrics.names import mtp_metrics
from pipetrain.plan import Plan
from pipetrain.train.data import eval_tokens, split_microbatches
from pipetrain.train.trainer import Trainer

EVAL_FILE = "eval.json"
PAD = -1  # the loss's ignore_index (models/causal_lm.py)


def eval_token_file(data: DataConfig) -> str:
    """What mode=eval reads, as eval.json names it: data.val_path when set, else data.path
    (train/data.py: eval_tokens reads it: a file, a folder or glob of shards); data=datasets: its sources."""
    if data.name == "datasets":
        return str(data.path) if not data.sources else ", ".join(str(s.path) for s in data.sources)
    if data.name != "tokens":
        raise ValueError(f"mode=eval reads token files or data=datasets: set data=tokens data.path=FILE "
                         f"(got data={data.name})")
    return str(data.val_path or data.path)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows i with i*T + T < N: i <= (N - 1 - T) / T, so (N - 1) // T of them."""
    return max(0, (num_tokens - 1) // seq_len)


def eval_batches(tokens: np.ndarray, *, seq_len: int, rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(inputs, targets, counted targets) per batch of `rows` windows, in order; the last batch
    padded with rows of input 0 and target -1."""
    t, total = seq_len, num_windows(len(tokens), seq_len)
    for first in range(0, total, rows):
        count = min(rows, total - first)
        # Window i is tokens [i*T, i*T + T]: one (count, T + 1) array read from the file.
        windows = np.asarray(tokens[first * t: (first + count) * t + 1], dtype=np.int64)
        idx = np.arange(count)[:, None] * t + np.arange(t + 1)  # (count, T + 1)
        w = torch.from_numpy(windows[idx])
        x = torch.zeros((rows, t), dtype=torch.int64)
        y = torch.full((rows, t), PAD, dtype=torch.int64)
        x[:count], y[:count] = w[:, :-1], w[:, 1:]  # (count, T) each
        yield x, y, count * t


def evaluate_file(trainer: Trainer, path: str) -> dict[str, Any]:
    """Collective over every rank: the exact mean loss over the windows of the eval tokens."""
    cfg = trainer.config
    vocab = cfg.model.vocab_size or 0
    tokens = eval_tokens(cfg.data, vocab_size=vocab)  # ids checked against model.vocab_size
    t = cfg.data.seq_len
    windows = num_windows(len(tokens), t)
    if windows == 0:
        raise ValueError(f"mode=eval: {path} holds {len(tokens):,} tokens, fewer than data.seq_len + 1 = {t + 1}: "
                         f"lower data.seq_len or use a longer file")
    t0 = time.perf_counter()
    total, counted, parts = mean_loss(trainer, eval_batches(tokens, seq_len=t, rows=cfg.data.batch_size))
    seconds = time.perf_counter() - t0
    return {"loss": total / counted, **parts, "tokens": counted, "windows": windows, "file": str(path), "seq_len": t,
            "seconds": seconds, "tokens_per_s": counted / seconds}


def mean_loss(trainer: Trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor, int]]
              ) -> tuple[float, int, dict[str, float]]:
    """(sum of loss x counted targets, counted targets, the parts reported beside the loss: `mtp/loss_k`, each
    averaged as the loss and left out of it: models/mtp.py) over global batches (inputs, targets, counted)."""
    cfg, total, counted, parts = trainer.config, 0.0, 0, [0.0] * trainer.pipe.executor.step_loss.parts
    m, eos = cfg.pipeline.microbatches, trainer.pipe.executor.batch.document_eos
    for x, y, n in batches:
        rows = trainer.parallel.local_batch((x, y))  # this rank's rows and (under cp) positions
        docs = trainer.parallel.local_documents((x, y), eos, m)  # under cp: cut from the whole rows
        loss = trainer.pipe.executor.evaluate(split_microbatches(rows, m), docs)
        assert loss is not None  # every rank gets the all-reduced mean
        total += loss * n
        counted += n
        parts = [p + q * n for p, q in zip(parts, trainer.pipe.executor.step_loss.part_means)]
    return total, counted, mtp_metrics([p / counted for p in parts] if counted else [])


def validation_rows(data: DataConfig, *, seed: int, vocab_size: int) -> list[Any]:
    """data=datasets: each source's rows (train/hf_data.py PackedRows) from the tokenized cache, whose "val"
    part mode=eval reads; one line where a source has none."""
    from pipetrain.train.hf_build import build_hf_data
    from pipetrain.train.hf_mix import MixedRows

    cached = copy.copy(data)
    cached.streaming = False  # null may mean streaming for large sources: eval reads each row once, from the cache
    built = build_hf_data(cached, seed=seed, vocab_size=vocab_size)
    sources = built.sources if isinstance(built, MixedRows) else [built]
    for s in sources:
        if "val" not in s.parts:
            raise ValueError(f"mode=eval: {s.what} has no validation rows: set data.val_split, or "
                             f"data.val_fraction > 0 (e.g. 0.1)")
    return sources


def row_batches(sources: list[Any], *, rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(inputs, targets, counted targets) per batch of `rows` validation rows, every source's in order;
    the last batch padded with rows of input 0 and target -1."""
    for src in sources:
        total = src.num_rows("val")
        for first in range(0, total, rows):
            count = min(rows, total - first)
            got_x, got_y, _ = src.rows("val", np.arange(first, first + count))
            x = torch.zeros((rows, got_x.shape[1]), dtype=torch.int64)
            y = torch.full((rows, got_y.shape[1]), PAD, dtype=torch.int64)
            x[:count], y[:count] = got_x, got_y
            yield x, y, int((y != PAD).sum())


def evaluate_datasets(trainer: Trainer) -> dict[str, Any]:
    """Collective over every rank: the exact mean loss over every validation row of data=datasets."""
    cfg = trainer.config
    sources = validation_rows(cfg.data, seed=cfg.trainer.seed, vocab_size=cfg.model.vocab_size or 0)
    t0 = time.perf_counter()
    total, counted, parts = mean_loss(trainer, row_batches(sources, rows=cfg.data.batch_size))
    seconds = time.perf_counter() - t0
    return {"loss": total / counted, **parts, "tokens": counted, "rows": sum(s.num_rows("val") for s in sources),
            "file": eval_token_file(cfg.data), "split": cfg.data.val_split or "held out", "seq_len": cfg.data.seq_len,
            "document_mask": cfg.data.masks_documents, "seconds": seconds, "tokens_per_s": counted / seconds}


def rank_eval(config: Config, plan: Plan, run_dir: Path) -> dict[str, Any]:
    """Entry point of one rank under mode=eval (the launcher's `entry`)."""
    run_dir = Path(run_dir)
    trainer = Trainer(config, plan, run_dir, train_data=False)  # eval reads its own token file
    trainer.resume()
    result = (evaluate_datasets(trainer) if config.data.name == "datasets" else
              evaluate_file(trainer, eval_token_file(config.data)))
    if trainer.rank != 0:
        return {}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
