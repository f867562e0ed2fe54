"""mode=export: a Llama-family or GPT-2 model as a Hugging Face folder that `from_pretrained` loads
(GPT-2: a GPT2LMHeadModel folder, its Conv1D weights transposed as HF stores them: models/hf_gpt2.py).

The weights come from, in order: the checkpoint trainer.resume names (DCP, keyed by unsplit
names: train/checkpoint.py), else model.pretrained's files, else the seeded initial weights
(models/init.py: the same values a training run starts from). One process, no process group:
the shards are planned from the shapes of the model built on meta, then filled one at a time
(a DCP load of just that shard's keys), so at most one shard is in memory.

What is written (as save_pretrained does): config.json (models/hf.hf_config), the tensors under
HF's names (MoE experts per expert, or fused with export.moe_layout=fused: models/hf_moe.py) in
model-0000i-of-0000n.safetensors of at most export.max_shard_gb each, their
model.safetensors.index.json (always, one shard too), and the tokenizer files of
data.tokenizer_dir or model.pretrained when they hold any. Atomic: everything goes into a
hidden sibling directory first, which is renamed to export.dir when complete.

Nothing it did not create is lost (`check_out`, before any weight is read): export.dir may be
new or an empty folder; a non-empty one is replaced only with export.overwrite=true, a file
never, and a folder the export reads from (model.pretrained, data.tokenizer_dir, the
checkpoint) or the run directory never, neither itself nor a folder holding it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Callable, Hashable, Optional

import torch

from pipetrain.config import Config
from pipetrain.config.deepseek import DeepSeekModelConfig
from pipetrain.config.llama import LlamaModelConfig
from pipetrain.config.models import GPT2ModelConfig
from pipetrain.files import replace_dir
from pipetrain.models.hf import CONFIG, INDEX, TOKENIZER_FILES, HFNames, folder_of, hf_config, names_of, pretrained_rule
from pipetrain.models.init import param_generator
from pipetrain.plan import build_model
from pipetrain.train.checkpoint_meta import preflight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Fill = Callable[[dict[str, torch.Tensor]], None]  # fills fp32 tensors keyed by unsplit names


def plan_shards(sizes: dict[Hashable, int], max_bytes: int) -> list[list[Hashable]]:
    """Names in order, cut into consecutive shards of at most max_bytes (a larger tensor alone)."""
    shards: list[list[Hashable]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def units(params: dict[str, torch.Tensor], hf: HFNames) -> list[tuple[str, ...]]:
    """The names in order, grouped into what is written together: a fused gate_up_proj is made of two
    weights (w1, w3), which must land in one shard; every other weight is a unit of its own."""
    grouped: dict[str, list[str]] = {}
    for name, p in params.items():
        pieces = hf.pieces(name, tuple(p.shape))
        fused = pieces is not None and len(pieces) == 1 and pieces[0].part is not None
        grouped.setdefault(pieces[0].key if fused else name, []).append(name)
    return [tuple(names) for names in grouped.values()]


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


def source(config: Config, ckpt: Optional[Path], model: object) -> tuple[Fill, str]:
    """Where the weights come from (ckpt: trainer.resume's checkpoint, if any), and a few words saying so."""
    if ckpt is not None:
        return checkpoint_fill(ckpt), f"checkpoint {ckpt}"
    weights = pretrained_rule(config.model)
    if weights is not None:
        return rule_fill(weights, config.trainer.seed), f"model.pretrained={config.model.pretrained}"
    return rule_fill(model, config.trainer.seed), f"the initial weights of trainer.seed={config.trainer.seed}"


def tokenizer_source(config: Config) -> Optional[Path]:
    for where in (config.data.tokenizer_dir, config.model.pretrained):
        if where and any((folder_of(where) / f).is_file() for f in TOKENIZER_FILES):
            return folder_of(where)
    return None


def run_export(config: Config, run_dir: Path, *, note: Callable[[str], None] = print) -> Path:
    """Write the folder; returns its path."""
    cfg = config.model
    if not isinstance(cfg, (LlamaModelConfig, GPT2ModelConfig, DeepSeekModelConfig)):
        raise ValueError(f"mode=export writes Llama-family and GPT-2 models (model=llama-tiny, llama3.2-1b, gpt2, "
                         f"...); model={cfg.name} has no Hugging Face form here")
    model_type = hf_config(cfg, dtype=config.export.dtype)["model_type"]  # a model HF cannot express fails here
    ckpt = preflight(config, run_dir)  # a checkpoint named explicitly is hashed: once
    out = check_out(config, run_dir, ckpt)
    dtype = DTYPES[config.export.dtype]
    model = build_model(cfg, device="meta")  # shapes only
    params = dict(model.named_parameters())  # distinct: a tied head is the embedding's entry
    sizes = {name: p.numel() * dtype.itemsize for name, p in params.items()}
    # an MoE weight is one stacked tensor here and one per expert (or a fused one) in the folder
    hf = names_of(cfg.knobs(), model_type=model_type, fused=config.export.moe_layout == "fused")
    max_bytes = int(config.export.max_shard_gb * 1e9)
    grouped = plan_shards({unit: sum(sizes[n] for n in unit) for unit in units(params, hf)}, max_bytes)
    shards = [[name for unit in shard for name in unit] for shard in grouped]
    fill, what = source(config, ckpt, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name, made exclusively: an older ".hf.tmp" beside it may be anyone's, so it is never
    # reused or removed (not tempfile.mkdtemp: its 0700 would become the export's permissions)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        copied, tok = _write(config, tmp, shards, params, hf, fill, dtype)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: nothing of a failed export is left
        raise
    extra = f", tokenizer files from {tok}" if copied else ""
    note(f"export: {what} -> {out} ({len(shards)} shard(s), {sum(sizes.values()) / 1e6:.1f} MB "
         f"{config.export.dtype}{extra})")
    return out


def _write(config: Config, tmp: Path, shards: list[list[str]], params: dict, hf: HFNames,
           fill: Fill, dtype: torch.dtype) -> tuple[list[str], Optional[Path]]:
    """The folder's files into tmp; returns the tokenizer files copied and their source."""
    from safetensors.torch import save_file

    cfg = config.model
    config_json = hf_config(cfg, dtype=config.export.dtype)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.empty(params[name].shape, dtype=torch.float32) for name in names}
        fill(tensors)
        out = hf.to_hf(tensors)
        save_file({k: t.to(dtype).contiguous() for k, t in out.items()}, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in out})
        total += sum(t.numel() for t in out.values()) * dtype.itemsize  # what the folder holds
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / CONFIG).write_text(json.dumps(config_json, indent=2) + "\n")
    tok = tokenizer_source(config)
    copied = [f for f in TOKENIZER_FILES if tok is not None and (tok / f).is_file()]
    for f in copied:
        shutil.copyfile(tok / f, tmp / f)
    return copied, tok


def check_out(config: Config, run_dir: Path, ckpt: Optional[Path]) -> Path:
    """export.dir (absolute), or a one-line ValueError when writing there could lose a file the
    export did not create. Reads nothing but the directory tree: it runs before any weight does."""
    given = config.export.dir
    out = Path(os.path.abspath(Path(given).expanduser() if given else Path(run_dir) / "hf"))
    key = f"export.dir={given}" if given else f"export.dir (default {out})"
    if out.parent == out:
        raise ValueError(f"{key} is a filesystem root: name a new or empty folder, e.g. export.dir=runs/hf")
    for above in (out, *out.parents):
        if above.exists() and not above.is_dir():
            where = "is a file" if above == out else f"is inside {above}, which is a file"
            raise ValueError(f"{key} {where}: name a new or empty folder, e.g. export.dir={out.parent}/hf")
    for what, folder in _read_from(config, run_dir, ckpt):
        folder = folder.resolve()
        if out.resolve() == folder or out.resolve() in folder.parents:
            where = "is" if out.resolve() == folder else f"holds {folder},"
            raise ValueError(f"{key} {where} {what}: export into another folder (export.overwrite=true never "
                             f"replaces a folder the export reads from or runs in)")
    if out.is_dir() and not config.export.overwrite:
        held = sorted(p.name for p in out.iterdir())
        if held:
            raise ValueError(f"{key} is not empty ({len(held)} entries, e.g. {held[0]}): set export.overwrite=true "
                             f"to replace the folder and everything in it, or name a new or empty folder")
    return out


def _read_from(config: Config, run_dir: Path, ckpt: Optional[Path]) -> list[tuple[str, Path]]:
    """(what, folder) of every folder the export reads from or runs in: never replaced."""
    out = []
    if config.model.pretrained:
        out.append(("model.pretrained's folder", folder_of(config.model.pretrained)))
    if config.data.tokenizer_dir:
        out.append(("data.tokenizer_dir", folder_of(config.data.tokenizer_dir)))
    if ckpt is not None:
        out.append(("the checkpoint it exports", Path(ckpt)))
    return out + [("this run's directory", Path(run_dir))]
