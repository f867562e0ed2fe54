"""Composing a config: what Hydra must know first, and the step from DictConfig to typed Config.

One place for what the CLI, the sbatch renderer (launch/sbatch.py) and the tests each need
before Hydra composes: the schemas (pipetrain/config/), the recipes (the `recipe` group) and
the OmegaConf resolvers of the cluster configs (launch/resolvers.py). Nothing is registered
at import time; `register_all()` does it, once per process.
"""

from __future__ import annotations

import difflib
import functools
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipetrain.compat_hydra import child_node, is_unset
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


def group_options(group: str, dirs: Sequence[str] = ()) -> list[str]:
    """Options of a config group: conf/<group>/*.yaml, then each --config-dir's <group>/."""
    roots = [Path(CONF_DIR), *(Path(d).expanduser() for d in dirs)]
    names: list[str] = []
    for root in roots:
        names += [p.stem for p in sorted((root / group).glob("*.yaml")) if p.stem not in names]
    return names


def search_path(dirs: Sequence[str]) -> list[str]:
    """The override that puts `--config-dir` folders on Hydra's search path for compose() ([] for none)."""
    if not dirs:
        return []
    return [f"hydra.searchpath=[{','.join('file://' + str(Path(d).expanduser().resolve()) for d in dirs)}]"]


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


def check_overrides(overrides: Sequence[str], dirs: Sequence[str] = ()) -> None:
    """Raise a one-line ValueError, with the nearest name, for an override that names no option of
    its group (`model=llama-tny`) or no config key (`trainer.max_step=10`), where Hydra's own
    message runs to eight lines and its hint (`+trainer.max_step=10`) leads to a second error.
    Whatever this cannot pin on one override (syntax, values) is left to Hydra's message. Composes
    once (~0.1 s) where a `key=value` override is to be checked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra's syntax error is the message
        return
    groups = _groups(dirs)
    chosen: list[str] = []  # the group choices (a sweep's first), to compose the keys the others must name
    keys: list[str] = []
    for o in parsed:
        name = o.key_or_group
        if name == "hydra" or name.startswith(("hydra.", "hydra/")) or o.package is not None:
            continue
        if name in groups and not o.is_delete():
            values = _choices(o)
            options = [*group_options(name, dirs), *_stored_options(name)]
            wrong = [v for v in values if v not in options and name != "recipe"]  # recipes: check_recipe_args
            if wrong:
                raise ValueError(_no_option(name, wrong[0], [n for n in options if not n.endswith("_schema")]))
            if values:
                chosen.append(f"{'+' if o.is_add() else ''}{name}={values[0]}")
        elif o.type is OverrideType.CHANGE:
            keys.append(name)
    keys = [key for key in keys if not schema_declares(key)]  # the rest (model.*, typos) checked as composed
    if not keys:
        return
    try:
        cfg = compose([*chosen, *search_path(dirs)])
    except Exception:  # noqa: BLE001 - a choice that fails to compose: Hydra says why
        return
    for key in keys:
        missing = _missing_key(cfg, key)
        if missing is not None:
            raise ValueError(missing)


def _groups(dirs: Sequence[str]) -> set[str]:
    """The config groups: conf/'s folders of options, each --config-dir's, and `recipe`."""
    roots = [Path(CONF_DIR), *(Path(d).expanduser() for d in dirs)]
    return {p.name for root in roots if root.is_dir() for p in root.iterdir() if any(p.glob("*.yaml"))} | {"recipe"}


def _stored_options(group: str) -> list[str]:
    """A group's options in Hydra's ConfigStore (the model schemas): valid choices, if not for users."""
    node = ConfigStore.instance().repo.get(group, {})
    return [Path(name).stem for name in node] if isinstance(node, dict) else []


def _choices(override: object) -> list[str]:
    """The option names an override picks (each of a sweep's); [] where they are not plain names."""
    value = override.value()  # type: ignore[attr-defined]
    if override.is_sweep_override():  # type: ignore[attr-defined]
        try:
            return [str(v) for v in override.sweep_string_iterator()]  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - glob(...) and other sweeps Hydra expands itself
            return []
    return [value] if isinstance(value, str) else []


def _no_option(group: str, value: str, options: Sequence[str]) -> str:
    near = difflib.get_close_matches(value, options, n=1)
    if near:
        return f"{group}={value} is not a {group} option; did you mean {group}={near[0]}?"
    return f"{group}={value} is not a {group} option: choose {group}= one of {', '.join(options)}"


def schema_declares(key: str) -> bool:
    """Whether the typed schema (config.Config and the dataclasses under it) declares the dotted `key` whatever
    the group choices: such a key needs no compose to be checked (~0.3 s of every command that overrides one).
    False where the schema cannot say: under `model` (its schema is the model= choice's) or a free-form node."""
    import dataclasses
    import typing

    from pipetrain.config import Config

    node: Any = Config
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = hints[part]
        args = [a for a in typing.get_args(node) if a is not type(None)]
        if typing.get_origin(node) is typing.Union and len(args) == 1:  # Optional[X]: X's keys
            node = args[0]
    return True


def _missing_key(cfg: DictConfig, key: str) -> str | None:
    """The message for a dotted key the composed config lacks (None where it has it, or where
    it is not this function's to say: a path through a list, a null or a free-form dict)."""
    import dataclasses

    node: object = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or is_unset(node):
            return None
        if part not in node.keys():
            if not dataclasses.is_dataclass(OmegaConf.get_type(node)):
                return None
            parent = ".".join(parts[:i])
            siblings = [str(k) for k in node.keys()]
            near = difflib.get_close_matches(part, siblings, n=1)
            if near:
                return f"{key} is not a config key; did you mean {'.'.join([*parts[:i], near[0], *parts[i + 1:]])}?"
            where = f"{parent}'s keys" if parent else "the top-level keys"
            return f"{key} is not a config key; {where}: {', '.join(siblings)}"
        node = child_node(node, part)
    return None


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys a `+key=value` override added that no schema declares (OmegaConf keeps them silently)."""
    import dataclasses

    kind = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(kind):
        return []
    declared = {f.name for f in dataclasses.fields(kind)}
    out = []
    for key in cfg.keys():
        node = child_node(cfg, key)
        if key not in declared:
            out.append(f"{prefix}{key}")
        elif isinstance(node, DictConfig) and not is_unset(node):
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
