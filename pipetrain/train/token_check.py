"""Token ids beyond the model's vocabulary, found before any rank starts (issue 25: the ranks found
them only once started). data=tokens only: every id of a stream of at most FULL_SCAN_TOKENS is read
(numpy's max over a memory map: about 0.1 s per 10^8 uint16 ids), as the ranks do (train/data.py);
a longer stream is sampled here and checked batch by batch in the ranks. Outside pipetrain/config/,
whose schemas stay importable without numpy; the launcher calls it (cli.run) before `launch`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipetrain.config.shards import Shard

if TYPE_CHECKING:
    from pipetrain.config import Config

FULL_SCAN_TOKENS = 1 << 27  # 128 Mi ids: the launcher's check and the ranks' (train/data.py) read all up to it
SAMPLE_RUNS, SAMPLE_RUN_TOKENS = 64, 1 << 16  # a longer stream: 64 evenly spaced runs of 64 Ki ids per shard


def token_id_range(shards: list[Shard]) -> tuple[tuple[int, str], tuple[int, str]]:
    """((the smallest token id in `shards`, the file holding it), (the largest, its file)): every id of
    a stream of at most FULL_SCAN_TOKENS, else evenly spaced runs of each shard. The smallest is read
    only from signed dtypes (an int64 .npy may hold -1); unsigned ones count as 0."""
    full = sum(s.count for s in shards) <= FULL_SCAN_TOKENS
    low, top = (0, ""), (-1, "")
    for s in shards:
        if s.count == 0:
            continue
        dtype = np.dtype(s.dtype)
        ids = np.memmap(s.path, dtype=dtype, mode="r", offset=s.offset, shape=(s.count,))
        if full or s.count <= SAMPLE_RUNS * SAMPLE_RUN_TOKENS:
            runs = [ids]
        else:  # the first and last ids included
            runs = [ids[a:a + SAMPLE_RUN_TOKENS]
                    for a in (i * (s.count - SAMPLE_RUN_TOKENS) // (SAMPLE_RUNS - 1) for i in range(SAMPLE_RUNS))]
        m = max(int(r.max()) for r in runs)
        if m > top[0]:
            top = (m, str(s.path))
        if dtype.kind == "i" and (n := min(int(r.min()) for r in runs)) < low[0]:
            low = (n, str(s.path))
        del ids, runs  # unmap now: a run over thousands of shards keeps no map open
    return low, top


def check_token_ids(config: Config) -> None:
    """data=tokens, mode=train or eval: a one-line error when a shard the run reads holds a token id
    >= model.vocab_size. mode=eval reads the validation shards when there are any, else data.path's."""
    from pipetrain.config import Mode

    d, vocab_size = config.data, config.model.vocab_size
    if d.name != "tokens" or vocab_size is None or config.mode not in (Mode.train, Mode.eval):
        return
    train, val = d.token_shards()
    streams = ([val] if val else [train]) if config.mode is Mode.eval else [train, val]
    for shards in streams:
        (low, low_where), (top, where) = token_id_range(shards)
        knob = "data.val_path" if d.val_path and shards is val else "data.path"
        spec = d.val_path if knob == "data.val_path" else d.path
        if low < 0:
            raise ValueError(f"{knob}={spec}: {low_where} holds token id {low}: token ids must be >= 0; drop the "
                             f"negative ids (padding or ignore markers) from the token files")
        if top >= vocab_size:
            raise ValueError(f"{knob}={spec}: {where} holds token id {top} but model.vocab_size={vocab_size}: set "
                             f"model.vocab_size >= {top + 1}, or use tokens made with the model's tokenizer")
