"""What a checkpoint's meta.json says about the run that wrote it, and what may change on resume.

The fingerprint splits the config three ways: the model (must match to load), the layout
(pipeline, data- and tensor-parallel degrees, schedule, partition: free to change, the point of unsplit
names) and the training knobs (may change, but then the run no longer repeats the uninterrupted
one, so a change is reported). `preflight`: the CLI's check of trainer.resume before any rank starts.
Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from pipetrain.config import Config, Mode
from pipetrain.launch.env import slurm_requeues
from pipetrain.train.checkpoint_dirs import FRESH, META, refuse_overwrite, resolve_resume

FORMAT = 1  # the checkpoint layout this pipetrain writes and reads



def _flat(prefix: str, obj: Any) -> dict[str, Any]:
    d = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(obj)
    return json.loads(json.dumps({f"{prefix}.{k}": v for k, v in d.items()}, default=str))


def fingerprint(config: Config) -> dict[str, dict[str, Any]]:
    """model: must match to load. layout: free to change (the point of unsplit names). training:
    may change, but then the run no longer continues the uninterrupted one, so a change is reported."""
    p, s, part, t = config.pipeline, config.schedule, config.partition, config.trainer
    model = _flat("model", {"name": config.model.name, **config.model.knobs()})
    layout = {"pipeline.degree": p.degree, "pipeline.microbatches": p.microbatches, "schedule.name": s.name,
              "schedule.virtual_stages": s.virtual_stages, "partition.name": part.name,
              "partition.boundaries": part.boundaries, "parallel.dp_replicate": config.parallel.dp_replicate,
              "parallel.dp_shard": config.parallel.dp_shard, "parallel.tp": config.parallel.tp,
              "parallel.sequence_parallel": config.parallel.sequence_parallel}
    training = {"trainer.seed": t.seed, "trainer.max_steps": t.max_steps, **_flat("data", config.data),
                **_flat("optim", config.optim)}
    return {"model": model, "layout": json.loads(json.dumps(layout)), "training": training}


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """"key: old -> new" for each knob that differs; a nested group (model.moe) by the fields that
    differ in it, not as two whole dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes({f"{k}.{f}": v for f, v in a.items()}, {f"{k}.{f}": v for f, v in b.items()})
        else:
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


def check_compatible(meta: dict[str, Any], config: Config, path: Path) -> list[str]:
    """Raise (one line) if the model differs; return notes on changed layout / training knobs."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"trainer.resume: {path} has checkpoint format {meta.get('format')!r}, "
                         f"this pipetrain reads {FORMAT}: resume with the version that wrote it, "
                         "or start a new run (a new run.name)")
    old, new = meta["fingerprint"], fingerprint(config)
    model = _changes(old["model"], new["model"])
    if model:
        raise ValueError(f"trainer.resume: {path} was saved for another model ({'; '.join(model)}): "
                         f"set the model knobs back, or start a new run (a new run.name)")
    notes = []
    if layout := _changes(old["layout"], new["layout"]):
        notes.append("new layout (weights re-split by name): " + "; ".join(layout))
    if training := _changes(old["training"], new["training"]):
        notes.append("changed training knobs, the run will not repeat an uninterrupted one: " + "; ".join(training))
    return notes


def preflight(config: Config, run_dir: Path) -> Optional[Path]:
    """For the CLI, before any process starts: the checkpoint trainer.resume names (None: fresh),
    checked against this run's model. Raises the same one-line ValueErrors the ranks would. A
    checkpoint named explicitly is checked byte by byte here; `auto` by sizes (the ranks read the
    bytes before loading, each a share, and report a damaged one they pass over)."""
    resume = config.trainer.resume
    if config.mode is Mode.train and not slurm_requeues():  # a requeued job goes on with its own checkpoints
        refuse_overwrite(resume, run_dir)
    explicit = resume not in (None, *FRESH, "auto")
    path = resolve_resume(resume, run_dir, deep=explicit)
    if path is not None:
        check_compatible(read_meta(path), config, path)
    return path


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())
