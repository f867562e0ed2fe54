"""Composing a config: what Hydra must know first, and the step from DictConfig to typed Config.

One place for what the CLI, the sbatch renderer (launch/sbatch.py) and the tests each need
before Hydra composes: the schemas (pipetrain/config/), the recipes (the `recipe` group) and
the OmegaConf resolvers of the cluster configs (launch/resolvers.py). Nothing is registered
at import time; `register_all()` does it, once per process.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipetrain.config import Config, register_configs
from pipetrain.launch.resolvers import register_resolvers

CONF_DIR = str(resources.files("pipetrain.conf"))


def recipe_files(config_dirs: Sequence[str] = ()) -> dict[str, Path]:
    """Recipes by name: the shipped ones (recipes/*.yaml), then `<dir>/recipe/*.yaml` of each
    `--config-dir` (Hydra puts those on its search path, so `+recipe=NAME` finds them)."""
    root = resources.files("pipetrain.recipes")
    out = {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}
    for d in config_dirs:
        out.update({p.stem: p for p in sorted((Path(d).expanduser() / "recipe").glob("*.yaml"))})
    return out


def config_dirs(argv: Sequence[str]) -> list[str]:
    """The `--config-dir DIR` / `--config-dir=DIR` / `-cd DIR` arguments of a command line."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--config-dir="):
            out.append(arg.partition("=")[2])
    return out


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
    known = recipe_files(config_dirs(argv))
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "recipe" and value not in known:
            raise ValueError(f"unknown recipe {value!r}: choose +recipe= one of {', '.join(sorted(known))}")


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys a `+key=value` override added that no schema declares (OmegaConf keeps them silently)."""
    import dataclasses

    kind = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(kind):
        return []
    declared = {f.name for f in dataclasses.fields(kind)}
    out = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if key not in declared:
            out.append(f"{prefix}{key}")
        elif isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            out.extend(unknown_keys(node, f"{prefix}{key}."))
    return out


def to_config(cfg: DictConfig) -> Config:
    if "recipe" in cfg:
        if not isinstance(cfg.recipe, str):  # a recipe file composed under `recipe:`, not at the root
            raise ValueError("a recipe file must start with the line `# @package _global_` so its keys land at "
                             "the root (pipeline.degree, not recipe.pipeline.degree): add it")
        raise ValueError(f"unknown recipe {cfg.recipe!r}: choose +recipe= one of {', '.join(sorted(recipe_files()))}")
    unknown = [k for k in unknown_keys(cfg) if k != "hydra"]
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]}: no setting has that name; drop +{unknown[0]}=... "
                         f"(or fix its spelling: `pipetrain --cfg job` lists every key)")
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    return config


@functools.cache
def register_all() -> None:
    """Schemas, recipes and resolvers: call before composing. Once per process (loading the
    recipes costs ~40 ms, a fifth of a compose); later calls do nothing."""
    register_configs()
    register_recipes()
    register_resolvers()


def compose(overrides: Sequence[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    """Compose the shipped config with these overrides, as `pipetrain` would (untyped)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_all()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """Compose and check: the typed Config the run would get."""
    return to_config(compose(overrides))
