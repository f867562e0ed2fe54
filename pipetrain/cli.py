"""`pipetrain`: compose the Hydra config, turn it into typed dataclasses, run.

User mistakes end as one clear message and a non-zero exit (set HYDRA_FULL_ERROR=1
for the traceback). Configs ship inside the package (`pipetrain.conf`), so the
command works from any directory after `pip install .` or `pip install -e .`.
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipetrain.config import Config, Mode, register_configs
from pipetrain.launch import RankFailedError

CONF_DIR = str(resources.files("pipetrain.conf"))
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


def recipe_files() -> dict[str, Path]:
    """Shipped recipes by name (recipes/*.yaml)."""
    root = resources.files("pipetrain.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def register_recipes() -> None:
    """Make recipes/ the config group `recipe` (so `+recipe=NAME` works from any directory).

    The files carry `# @package _global_`; they are stored at the global package
    with their defaults lists intact, so `override /schedule: ...` inside a recipe
    works and a later command-line `schedule=...` still wins.
    """
    cs = ConfigStore.instance()
    for name, path in recipe_files().items():
        cs.store(group="recipe", name=name, node=OmegaConf.load(path), package="_global_")


def check_recipe_args(argv: Sequence[str]) -> None:
    """Fail early, with the list, on an unknown recipe (Hydra would otherwise add a plain `recipe` key)."""
    known = recipe_files()
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "recipe" and value not in known:
            raise ValueError(f"unknown recipe {value!r}: choose +recipe= one of {', '.join(sorted(known))}")


def to_config(cfg: DictConfig) -> Config:
    if "recipe" in cfg:
        raise ValueError(f"unknown recipe {cfg.recipe!r}: choose +recipe= one of {', '.join(sorted(recipe_files()))}")
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    return config


def run(config: Config, run_dir: Path) -> Any:
    from rich.console import Console

    from pipetrain.launch import launch
    from pipetrain.launch.resolvers import process_rank
    from pipetrain.simulate_cmd import plan_and_simulate, run_simulate

    if config.mode is Mode.simulate:
        return run_simulate(config, run_dir)
    # Train: everything is checked and simulated here, before any process starts.
    from pipetrain.train.checkpoint import preflight  # imports torch: only on the training path

    preflight(config, run_dir)  # a bad trainer.resume fails here, not in every rank
    # Under torchrun / SLURM every process is a rank and composes the config: one of them reports.
    quiet = process_rank(config.cluster.name) != 0
    plan, _ = plan_and_simulate(config, run_dir, Console(quiet=quiet), timeline=False, write=not quiet)
    return launch(config, plan, run_dir)


def _fail(err: BaseException) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    print(f"pipetrain: error: {err}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    try:
        config = to_config(cfg)
        return run(config, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        _fail(_unwrap(e))
    except RankFailedError as e:  # the failing rank's one-line message; its traceback is on disk
        _fail(e)


def _unwrap(err: BaseException) -> BaseException:
    """OmegaConf wraps exceptions raised in __post_init__; show the user the original message."""
    while err.__cause__ is not None and isinstance(err.__cause__, USER_ERRORS):
        err = err.__cause__
    return err


def main() -> None:
    from pipetrain.launch.resolvers import register_resolvers

    register_configs()
    register_recipes()
    register_resolvers()
    try:
        check_recipe_args(sys.argv[1:])
    except ValueError as e:
        _fail(e)
    _hydra_main()


if __name__ == "__main__":
    main()
