"""What `model.pretrained=DIR` changes besides the weights: the defaults of a fine-tune, chosen in one
place (`pretrained_defaults`, called by the root schema), and the header lines that say so.

- Text (data=builtin, data=text) is tokenized with the folder's tokenizer.json when data.tokenizer
  is left null (data.tokenizer=hf data.tokenizer_dir=DIR); a folder without one keeps the byte
  tokens, and the header says so. Token shards are checked against the same tokenizer
  (token_origin.py).
- optim.lr / optim.min_lr / optim.warmup_steps left null get the fine-tune values (train.py:
  OptimConfig.defaults): a pre-training lr (3e-3) would wreck the pretrained weights in a few steps.

- The model family: a command that names no `model=` (and no recipe, which may) takes the preset of
  the folder's config.json `model_type` (`with_family`): llama-tiny for the Llama family, moe-tiny for
  its MoE folders, deepseek-tiny for deepseek_v3 / deepseek_v2, gpt2 for GPT-2. The folder's config.json
  then sets every knob over the preset, as with any `model=` of the family, so which preset of it carries
  them changes nothing.

"Left null" is how a knob the user did not set is told apart: conf/ and the recipes leave these
null, so anything else was set on the command line or in a recipe, and wins. Pure Python.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pipetrain.config.data import HF_TOKENIZER, DataConfig
from pipetrain.config.deepseek import HF_DEEPSEEK_TYPES
from pipetrain.config.llama import HF_MODEL_TYPES
from pipetrain.config.moe import HF_MOE_TYPES
from pipetrain.config.token_origin import RECORD, check_origin, tokenizer_file
from pipetrain.config.train import OptimConfig


def family_preset(folder: str) -> str | None:
    """The `model=` preset that carries a pretrained folder's family (module docstring); None where its
    config.json is missing or names a model_type pipetrain does not build (the root schema then says so)."""
    try:
        kind = json.loads((Path(folder).expanduser() / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    if kind == "gpt2":
        return "gpt2"
    if kind in HF_MOE_TYPES:
        return "moe-tiny"
    if kind in HF_DEEPSEEK_TYPES:
        return "deepseek-tiny"
    return "llama-tiny" if kind in HF_MODEL_TYPES else None


def with_family(argv: Sequence[str]) -> list[str]:
    """`argv` with `model=<preset>` added where it sets model.pretrained but no model= and no recipe."""
    keys = {a.partition("=")[0].lstrip("+~") for a in argv if "=" in a}
    folder = next((a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "model.pretrained"), None)
    if not folder or "model" in keys or "recipe" in keys:
        return list(argv)
    preset = family_preset(folder)
    return list(argv) if preset is None else [*argv, f"model={preset}"]


def folder_tokenizer(folder: str) -> Path | None:
    """The folder's tokenizer.json, if it has one."""
    path = Path(folder).expanduser() / HF_TOKENIZER
    return path if path.is_file() else None


def pretrained_defaults(folder: str | None, data: DataConfig, optim: OptimConfig, *, steps: int) -> None:
    """Fill data.tokenizer and the optimizer's schedule knobs left null: from model.pretrained's `folder`
    for a fine-tune (warm-up: a share of `steps`), else the pre-training defaults (byte tokens, lr 3e-3)."""
    if data.tokenizer is None:
        if folder is not None and folder_tokenizer(folder) is not None and data.name != "synthetic":
            data.use_tokenizer("hf", folder)
        elif data.uses_tokenizer:  # checked as byte already (tokenizer_name); data.tokenizer_dir alone was refused
            data.tokenizer = "byte"
            data.check_tokenizer()  # data.add_bos (and data=sft's chat template) were left to this choice
        # token shards and synthetic data keep null: no tokenizer was chosen, so none is checked (token_origin.py)
    optim.defaults(fine_tune=folder is not None, steps=steps)


def header_lines(folder: str | None, data: DataConfig, optim: OptimConfig) -> list[str]:
    """model.pretrained=`folder`: the tokenizer the run uses and where it came from, shards with no
    record of theirs, and the fine-tune defaults applied; [] for a run without model.pretrained."""
    if folder is None:
        return []
    lines = []
    if data.name != "synthetic":
        name, own = data.tokenizer_name, folder_tokenizer(folder)
        path = tokenizer_file(name, data.tokenizer_dir)
        if own is None:
            why = (f"model.pretrained={folder} has no {HF_TOKENIZER}, so its ids may not be the model's: set "
                   f"data.tokenizer=hf data.tokenizer_dir=DIR to use one")
        elif name == "hf" and path is not None and path.resolve() == own.resolve():
            why = "from model.pretrained"
        else:
            why = f"data.tokenizer, not model.pretrained's {HF_TOKENIZER}"
        lines.append(f"tokenizer: {name} ({f'{path}, ' if path else ''}{why})")
        for shards in check_origin(data):
            lines.append(f"tokenizer: {shards} holds no {RECORD} (pipetrain-prepare writes one), so its ids are "
                         f"not checked against this tokenizer")
    if optim.defaulted:
        lines.append(f"fine-tune defaults: {' '.join(optim.defaulted)} (model.pretrained; set them to "
                     f"override)")
    return lines
