"""Schema of `logger=[...]` and `logging.*`. Pure: no torch, no wandb.

`logger` picks the destinations (default console + jsonl); `logging` holds their options:

    pipetrain logger=[console,jsonl,trace,wandb,tensorboard] logging.wandb_project=my-proj \
        logging.wandb_tags=[zbv,p4] logging.trace_step=20 logging.peak_tflops=989
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LOGGERS = ("console", "jsonl", "trace", "wandb", "tensorboard")


def default_loggers() -> list[str]:
    return ["console", "jsonl"]


def check_loggers(names: list[str]) -> None:
    """`logger=[...]` names known destinations, each once."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"logger={unknown[0]!r} is unknown: choose logger=[...] from {', '.join(LOGGERS)} "
                         f"(e.g. logger=[console,jsonl,wandb])")
    if len(set(names)) != len(names):
        raise ValueError(f"logger={list(names)} names a logger twice: list each once")


@dataclass
class LoggingConfig:
    wandb_project: str = "pipetrain"  # wandb project the runs go to
    wandb_entity: Optional[str] = None  # team or user; None: wandb's default entity
    wandb_name: Optional[str] = None  # run name; None: "<schedule>-p<degree>-m<microbatches>"
    # runs grouped together in wandb; None: a `pipetrain -m` sweep's jobs share their sweep directory's
    # name (multirun/<date>/<time>), a single run has no group
    wandb_group: Optional[str] = None
    wandb_tags: list[str] = field(default_factory=list)  # extra wandb tags, e.g. [baseline,zbv]
    # The step drawn by the trace logger (trace.json) and the console's end-of-run timeline,
    # counted from 1 as the progress lines count; -1: the last step. That step is always measured.
    trace_step: int = -1
    timeline: bool = True  # console: draw the measured timeline of trace_step at the end
    # Peak dense TFLOP/s of ONE device, the denominator of MFU. None: the GPU's bf16 peak where
    # we know it (A100 312, H100/H200 989), else MFU is not reported (CPUs have no agreed peak).
    peak_tflops: Optional[float] = None

    def __post_init__(self) -> None:
        if self.trace_step == 0 or self.trace_step < -1:
            raise ValueError(
                f"logging.trace_step must be a step number >= 1 or -1 for the last (got {self.trace_step})")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"logging.peak_tflops must be > 0 TFLOP/s (got {self.peak_tflops}), or null")

    def check(self, loggers: list[str], *, max_steps: int) -> None:
        """Rules that need the rest of the config (called by Config.__post_init__)."""
        check_loggers(loggers)
        if self.trace_step > max_steps:
            raise ValueError(f"logging.trace_step={self.trace_step} is past trainer.max_steps={max_steps}: "
                             f"set logging.trace_step <= {max_steps} or -1 for the last step")

    def chosen_step(self, max_steps: int) -> int:
        return max_steps if self.trace_step == -1 else self.trace_step
