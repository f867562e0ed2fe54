"""`pipetrain --help`: groups and their options, every setting with its default and one line
from the schema's comment (config/describe.py), the recipes (shipped and `--config-dir`
ones), and examples. Plain text, never cut to the terminal's width.

Hydra's own help is still there: `--hydra-help`; `--cfg job` prints the composed config.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from pipetrain.compose import CONF_DIR, compose, config_dirs, group_options, recipe_files
from pipetrain.config import Config, MODEL_SCHEMAS
from pipetrain.config.describe import Setting, first_sentence, settings

# The config groups, in the order a user meets them (conf/<group>/*.yaml is one option each).
GROUPS = ("pipeline", "schedule", "model", "partition", "data", "cluster")
# Settings sections in the order printed: the groups, then the ungrouped settings.
SECTIONS = ("pipeline", "schedule", "partition", "data", "trainer", "optim", "checkpoint", "sim", "plan", "parallel",
            "cluster", "launch", "run", "logging", "profile", "export")
EXAMPLES = (
    ("pipetrain", "the quickstart: GPT-2 tiny, 2 ranks, 1F1B, 200 steps on CPU"),
    ("pipetrain mode=simulate model=sleep schedule=zbv pipeline.degree=8 pipeline.microbatches=32",
     "simulate and draw a schedule, no processes"),
    ("pipetrain -m mode=simulate model=sleep schedule=1f1b,zbh1,zbv", "a sweep: one comparison table"),
    ("pipetrain +recipe=gpt2 trainer.max_steps=1 data.batch_size=8 data.seq_len=128", "a recipe, overridden"),
    ("pipetrain model=llama-tiny schedule=zbh1 logger=[console,jsonl,wandb]", "another model, schedule and loggers"),
    ("pipetrain mode=plan model=llama3.1-8b plan.world_size=32 plan.memory_gb=80 plan.global_batch=256 "
     "data.seq_len=4096 plan.tp=[1,2,4]",
     "which layout, schedule, microbatching and recompute fit a cluster, ranked by simulation (plan.json)"),
    ("pipetrain schedule=auto", "plan on this machine, train the best row, report predicted vs measured"),
    ("pipetrain trainer.resume=auto hydra.run.dir=runs/a", "resume the newest checkpoint of a run"),
    ("pipetrain --cfg job model=gpt2", "print the composed config and exit"),
)


def first_comment(path: Path) -> str:
    """The first sentence of a config file's opening comment (Hydra's `# @package` aside)."""
    block: list[str] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("# @package"):
            continue
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    return first_sentence(" ".join(block))


def _composed(argv: Sequence[str]) -> object | None:
    """The config this command line composes to (for the defaults shown), or None."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    for attempt in (overrides, []):
        try:
            return compose(attempt)
        except Exception:  # noqa: BLE001 - help must print whatever the overrides say
            continue
    return None


def _rows(items: Sequence[Setting], cfg: object | None) -> list[str]:
    """`  key  value  what it does`; value: from `cfg` where given, else the schema's default."""
    width = max(len(s.key) for s in items)
    out = []
    for s in items:
        value = OmegaConf.select(cfg, s.key, default=None) if cfg is not None else None
        shown = s.default if value is None or OmegaConf.is_config(value) else _text(value)
        out.append(f"  {s.key:<{width}}  {shown:<10} {s.doc}".rstrip())
    return out


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "value", value))


def section_settings() -> dict[str, list[Setting]]:
    """Settings per section (model: one list per model family), from the schemas."""
    hints = typing.get_type_hints(Config)
    top = [s for s in settings(Config, "") if "." not in s.key and s.key != "model"]
    out: dict[str, list[Setting]] = {"": _with_choices(top, Config)}
    for name in SECTIONS:
        if name in hints:
            out[name] = _with_choices(list(settings(hints[name], name)), hints[name])
    for family, schema in MODEL_SCHEMAS.items():
        out[f"model ({family})"] = _with_choices(list(settings(schema, "model")), schema)
    return out


def _with_choices(items: list[Setting], schema: type) -> list[Setting]:
    """An enum setting's line starts with every value the enum has (`mode`: train | simulate |
    ... | plan), in place of the list its comment wrote by hand, which a new value outgrows."""
    hints = typing.get_type_hints(schema)
    out = []
    for s in items:
        kind = hints.get(s.key.rpartition(".")[2])
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = " | ".join(str(m.value) for m in kind)
            listed = re.match(r"[\w-]+(?: \| [\w-]+)+", s.doc)
            s = dataclasses.replace(s, doc=choices + s.doc[listed.end():] if listed else f"{choices}: {s.doc}")
        out.append(s)
    return out


def render(argv: Sequence[str]) -> str:
    dirs = config_dirs(argv)
    cfg = _composed(argv)
    lines = [
        "pipetrain: declarative pipeline-parallel training on torch.distributed",
        "",
        "usage: pipetrain [group=option ...] [key=value ...] [+recipe=NAME] [-m (a sweep: key=a,b,c)]",
        "       [--config-dir DIR (your own options: DIR/<group>/NAME.yaml, DIR/recipe/NAME.yaml)]",
        "",
        "groups (group=option; the default first):",
    ]
    defaults = _default_options()
    for group in GROUPS:
        options = group_options(group, dirs)
        first = defaults.get(group)
        options = ([first] if first in options else []) + [o for o in options if o != first]
        lines.append(f"  {group:<10} {', '.join(options)}")
    lines += ["", "recipes (+recipe=NAME):"]
    recipes, shipped = recipe_files(dirs), recipe_files()
    width = max(map(len, recipes))
    for name, path in sorted(recipes.items()):
        where = "" if shipped.get(name) == path else f" [from {path.parent.parent}]"
        lines.append(f"  {name:<{width}}  {first_comment(path)}{where}")
    lines += ["", "settings (key=value; the value this command line composes to, then what it does):"]
    family = _family(cfg)
    for title, items in section_settings().items():
        if not items:
            continue
        is_model = title.startswith("model")
        if is_model and family is not None:
            title += f": model={cfg.model.name} below" if f"({family})" in title else ": its schema's defaults"
        shown = cfg if not is_model or f"({family})" in title else None
        lines += [f" {title or 'top level'}:", *_rows(items, shown)]
    lines += ["", "examples:"]
    lines += [f"  {cmd}\n      {what}" for cmd, what in EXAMPLES]
    lines += ["", "more: README.md and docs/; --version; --hydra-help (Hydra's own flags); "
                  "--cfg job (the composed config)"]
    return "\n".join(lines) + "\n"


def _family(cfg: object | None) -> str | None:
    """The model family (MODEL_SCHEMAS key) of the composed config's model."""
    if cfg is None:
        return None
    schema = type(OmegaConf.to_object(cfg.model))  # type: ignore[attr-defined]
    return next((k for k, v in MODEL_SCHEMAS.items() if v is schema), None)


def _default_options() -> dict[str, str]:
    """group -> the option conf/config.yaml's defaults list picks."""
    out = {}
    for item in OmegaConf.load(Path(CONF_DIR) / "config.yaml").get("defaults", []):
        if isinstance(item, dict) or OmegaConf.is_dict(item):
            out.update({str(k): str(v) for k, v in dict(item).items()})
    return out
