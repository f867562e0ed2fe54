"""Schema of the `cluster` config group: where the ranks run (pure: no torch)."""

from __future__ import annotations

from dataclasses import dataclass

CLUSTERS = ("local",)


@dataclass
class ClusterConfig:
    name: str = "local"  # local: one process per rank on this host (torch elastic)

    def __post_init__(self) -> None:
        if self.name not in CLUSTERS:
            raise ValueError(f"cluster={self.name!r} is unknown: choose cluster= one of {', '.join(CLUSTERS)}")
