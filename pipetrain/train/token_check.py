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


def max_token_id(shards: list[Shard]) -> tuple[int, str]:
    """(the largest token id in `shards`, the file holding it): every id of a stream of at most
    FULL_SCAN_TOKENS, else evenly spaced runs of each shard."""
    full = sum(s.count for s in shards) <= FULL_SCAN_TOKENS
    top, where = -1, ""
    for s in shards:
        if s.count == 0:
            continue
        ids = np.memmap(s.path, dtype=np.dtype(s.dtype), mode="r", offset=s.offset, shape=(s.count,))
        if full or s.count <= SAMPLE_RUNS * SAMPLE_RUN_TOKENS:
            m = int(ids.max())
        else:
            starts = (i * (s.count - SAMPLE_RUN_TOKENS) // (SAMPLE_RUNS - 1) for i in range(SAMPLE_RUNS))
            m = max(int(ids[a:a + SAMPLE_RUN_TOKENS].max()) for a in starts)  # the first and last ids included
        if m > top:
            top, where = m, str(s.path)
        del ids  # unmap now: a run over thousands of shards keeps no map open
    return top, where


def check_token_ids(config: Config) -> None:
    """data=tokens, mode=train or eval: a one-line error when a shard the run reads holds a token id
    >= model.vocab_size. mode=eval reads the validation shards when there are any, else data.path's."""
    from pipetrain.config import Mode

    d, vocab_size = config.data, getattr(config.model, "vocab_size", None)
    if d.name != "tokens" or vocab_size is None or config.mode not in (Mode.train, Mode.eval):
        return
    train, val = d.token_shards()
    streams = ([val] if val else [train]) if config.mode is Mode.eval else [train, val]
    for shards in streams:
        top, where = max_token_id(shards)
        if top >= vocab_size:
            knob = "data.val_path" if d.val_path and shards is val else "data.path"
            spec = d.val_path if knob == "data.val_path" else d.path
            raise ValueError(f"{knob}={spec}: {where} holds token id {top} but model.vocab_size={vocab_size}: set "
                             f"model.vocab_size >= {top + 1}, or use tokens made with the model's tokenizer")
