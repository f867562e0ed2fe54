"""`build_loggers(logger=[...])`: the loggers a run asked for, in that order.

The factory, not the protocol's module, knows the concrete loggers: base.py stays what every
logger imports, and nothing it imports imports it back. Each logger is imported only when
asked for (wandb is heavy; rich is not needed by a jsonl-only run).
"""

from __future__ import annotations

from pipetrain.loggers.base import Logger


def build_loggers(names: list[str]) -> list[Logger]:
    """The loggers `logger=[...]` names, in that order (imports each only when asked for)."""
    out: list[Logger] = []
    for name in names:
        if name == "console":
            from pipetrain.loggers.console import ConsoleLogger

            out.append(ConsoleLogger())
        elif name == "jsonl":
            from pipetrain.loggers.jsonl import JsonlLogger

            out.append(JsonlLogger())
        elif name == "trace":
            from pipetrain.loggers.trace import TraceLogger

            out.append(TraceLogger())
        elif name == "tensorboard":
            from pipetrain.loggers.tensorboard import TensorBoardLogger

            out.append(TensorBoardLogger())
        elif name == "wandb":
            from pipetrain.loggers.wandb_logger import WandbLogger

            out.append(WandbLogger())
        else:  # LoggingConfig.check admits only the names above
            raise AssertionError(name)
    return out
