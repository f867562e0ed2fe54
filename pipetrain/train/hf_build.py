"""data=datasets as configured: one source's packed rows (train/hf_data.py; data=sft's chats: train/hf_sft.py),
a mixture of sources (train/hf_mix.py), or documents streamed and packed as they are read (train/hf_stream.py). Its own
module so that each of those imports only what it builds on (hf_mix and hf_stream build on hf_data).
"""

from __future__ import annotations

from typing import Any

from pipetrain.config.data import DataConfig
from pipetrain.config.data_sources import source_list, streams
from pipetrain.train.hf_data import source_rows
from pipetrain.train.tokenizer import load_tokenizer


def build_hf_data(cfg: DataConfig, *, seed: int, vocab_size: int) -> Any:
    """The data source of data=datasets: data.path's rows (PackedRows), data.sources' mixture of them
    (train/hf_mix.py), or with streaming documents packed as they are read (train/hf_stream.py)."""
    tok = load_tokenizer(cfg.tokenizer_name, cfg.tokenizer_dir)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"data.tokenizer={tok.name} has {tok.vocab_size:,} tokens but model.vocab_size={vocab_size}: "
                         f"set model.vocab_size >= {tok.vocab_size} or use a tokenizer that fits the model")
    sources = source_list(cfg)
    if streams(cfg):
        from pipetrain.train.hf_stream import StreamRows

        return StreamRows(cfg, sources, tok, seed=seed)
    rows_of = source_rows
    if cfg.name == "sft":  # chats rendered with the tokenizer's template, loss flags with the tokens
        from pipetrain.train.hf_sft import sft_rows

        rows_of = sft_rows
    if not cfg.sources:
        return rows_of(cfg, sources[0], tok, seed=seed, what=f"data.path={cfg.path} ({tok.name} tokens)")
    from pipetrain.train.hf_mix import MixedRows

    rows = [rows_of(cfg, s, tok, seed=seed, what=f"data.sources: {s.path} ({tok.name} tokens)", min_rows=1)
            for s in sources]
    return MixedRows(rows, [s.weight for s in sources], names=[s.label for s in sources], seed=seed)
