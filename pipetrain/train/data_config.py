"""Schema of the `data` config group (pure: no torch, so config.py stays importable without it)."""

from __future__ import annotations

from dataclasses import dataclass

DATA_SOURCES = ("builtin",)


@dataclass
class DataConfig:
    """Where batches come from. Today only the batch shape is read (to size a microbatch
    for the cost model); the data sources themselves come with the trainer."""

    name: str = "builtin"
    batch_size: int = 8  # sequences per optimizer step, split into pipeline.microbatches microbatches
    seq_len: int = 128  # tokens per sequence (GPT-2: <= model.block_size); short enough for a CPU step

    def __post_init__(self) -> None:
        if self.name not in DATA_SOURCES:
            raise ValueError(f"data={self.name!r} is unknown: choose data= one of {', '.join(DATA_SOURCES)}")
        for knob in ("batch_size", "seq_len"):
            if getattr(self, knob) < 1:
                raise ValueError(f"data.{knob} must be >= 1 (got {getattr(self, knob)})")
