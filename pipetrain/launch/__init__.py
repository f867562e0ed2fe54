"""Where the ranks run: launchers (cluster=local: launch/agent.py; torchrun; SLURM via submitit); their
schema is pipetrain/config/cluster.py, the resolvers of the cluster configs resolvers.py.

The names below load on first use (PEP 562), so that `pipetrain.launch.forkserver` is importable at the
command's first frame (pipetrain/__main__.py) without the config schemas that launcher.py imports."""

from __future__ import annotations

from typing import Any

_HOMES = {"RankFailedError": "pipetrain.launch.errors", "RunStopped": "pipetrain.launch.errors",
          "launch": "pipetrain.launch.launcher", "prestart": "pipetrain.launch.launcher"}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
