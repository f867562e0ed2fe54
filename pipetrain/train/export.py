"""mode=export: a Llama-family model as a Hugging Face folder that `from_pretrained` loads.

The weights come from, in order: the checkpoint trainer.resume names (DCP, keyed by unsplit
names: train/checkpoint.py), else model.pretrained's files, else the seeded initial weights
(models/init.py: the same values a training run starts from). One process, no process group:
the shards are planned from the shapes of the model built on meta, then filled one at a time
(a DCP load of just that shard's keys), so at most one shard is in memory.

What is written (as save_pretrained does): config.json (models/hf.hf_config), the tensors under
HF's names in model-0000i-of-0000n.safetensors of at most export.max_shard_gb each, their
model.safetensors.index.json (always, one shard too), and the tokenizer files of
data.tokenizer_dir or model.pretrained when they hold any. Atomic: everything goes into a
hidden sibling directory first, which is renamed to export.dir (an older export there is
replaced only then).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from pipetrain.config import Config
from pipetrain.config.models import LlamaModelConfig
from pipetrain.models.hf import CONFIG, INDEX, TOKENIZER_FILES, folder_of, hf_config, pretrained_rule
from pipetrain.models.init import param_generator
from pipetrain.models.llama import hf_name
from pipetrain.plan import build_model
from pipetrain.train.checkpoint import preflight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Fill = Callable[[dict[str, torch.Tensor]], None]  # fills fp32 tensors keyed by unsplit names


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into consecutive shards of at most max_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def checkpoint_fill(path: Path) -> Fill:
    def fill(tensors: dict[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # one process without a process group is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({f"model.{n}": t for n, t in tensors.items()}, checkpoint_id=path, no_dist=True)
    return fill


def rule_fill(rule, seed: int) -> Fill:  # noqa: ANN001 (an init rule: models/init.InitRule)
    def fill(tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            rule.init_parameter(name, t, param_generator(seed, name))
    return fill


def source(config: Config, run_dir: Path, model: object) -> tuple[Fill, str]:
    """Where the weights come from, and a few words saying so."""
    ckpt = preflight(config, run_dir)
    if ckpt is not None:
        return checkpoint_fill(ckpt), f"checkpoint {ckpt}"
    weights = pretrained_rule(config.model)
    if weights is not None:
        return rule_fill(weights, config.trainer.seed), f"model.pretrained={config.model.pretrained}"
    return rule_fill(model, config.trainer.seed), f"the initial weights of trainer.seed={config.trainer.seed}"


def tokenizer_source(config: Config) -> Optional[Path]:
    for where in (config.data.tokenizer_dir, getattr(config.model, "pretrained", None)):
        if where and any((folder_of(where) / f).is_file() for f in TOKENIZER_FILES):
            return folder_of(where)
    return None


def run_export(config: Config, run_dir: Path, *, note: Callable[[str], None] = print) -> Path:
    """Write the folder; returns its path."""
    cfg = config.model
    if not isinstance(cfg, LlamaModelConfig):
        raise ValueError(f"mode=export writes Llama-family models (model=llama-tiny, llama3.2-1b, qwen2.5-0.5b, ...); "
                         f"model={cfg.name} has no Hugging Face form here")
    out = Path(config.export.dir).expanduser() if config.export.dir else Path(run_dir) / "hf"
    dtype = DTYPES[config.export.dtype]
    model = build_model(cfg, device="meta")  # shapes only
    n = cfg.num_hidden_layers
    params = dict(model.named_parameters())  # distinct: a tied head is the embedding's entry
    sizes = {name: p.numel() * dtype.itemsize for name, p in params.items()}
    shards = plan_shards(sizes, int(config.export.max_shard_gb * 1e9))
    fill, what = source(config, run_dir, model)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that crashed
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.empty(params[name].shape, dtype=torch.float32) for name in names}
        fill(tensors)
        save_file({hf_name(k, num_hidden_layers=n): t.to(dtype).contiguous() for k, t in tensors.items()},
                  str(tmp / file), metadata={"format": "pt"})
        weight_map.update({hf_name(k, num_hidden_layers=n): file for k in names})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / CONFIG).write_text(json.dumps(hf_config(cfg, dtype=config.export.dtype), indent=2) + "\n")
    tok = tokenizer_source(config)
    copied = [f for f in TOKENIZER_FILES if tok is not None and (tok / f).is_file()]
    for f in copied:
        shutil.copyfile(tok / f, tmp / f)
    _replace(tmp, out)
    extra = f", tokenizer files from {tok}" if copied else ""
    note(f"export: {what} -> {out} ({len(shards)} shard(s), {sum(sizes.values()) / 1e6:.1f} MB "
         f"{config.export.dtype}{extra})")
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is moved aside first and removed after."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
