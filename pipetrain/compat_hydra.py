"""Every private Hydra and OmegaConf API pipetrain uses, in one place: compat.py's sibling for the config side.

A separate door because compat.py imports torch and composing a config must not (`pipetrain --help`,
`mode=simulate`). Hydra and OmegaConf keep no promise about names with a leading underscore; each
function below says what it reaches into and why no public API does the job. Checked on Hydra 1.3.8 and
OmegaConf 2.3.1; an upgrade of either starts by reading this file.
"""

from __future__ import annotations

from typing import Any, Sequence

from omegaconf import DictConfig


def child_node(cfg: DictConfig, key: str) -> Any:
    """The node under `key`, as stored (`DictConfig._get_node`): `cfg[key]` would resolve interpolations
    and raise on `???`, and the key checks must walk a config whose values are not all set."""
    return cfg._get_node(key)


def is_unset(node: Any) -> bool:
    """Whether a config node is null or `???` (`Node._is_none()` / `Node._is_missing()`), asked of the node
    itself: OmegaConf's public `is_missing(cfg, key)` needs the parent and has no `is_none` beside it."""
    return node._is_none() or node._is_missing()


def sweep_batches(overrides: Sequence[Any]) -> list[list[list[str]]]:
    """Hydra's basic sweeper's jobs for parsed overrides, batch by batch, in the order it runs them
    (`hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments`): `--multirun` checks every
    job before any starts, and no public Hydra API expands a sweep."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper.split_arguments(list(overrides), None)
