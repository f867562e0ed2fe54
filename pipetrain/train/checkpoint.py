"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the unsplit model's names.

Why DCP and unsplit names: a stage keeps the unsplit parameter names ("layers.3.attn.c_attn.weight",
models/split.py), so the union over ranks of what they save IS the unsplit model's state dict.
A run saved at one pipeline degree / data-parallel degree / schedule / partition therefore
loads at another (FSDP2 shards are DTensors: DCP writes each shard and re-shards on load;
replicas write the same key and DCP keeps one): each rank
asks DCP for the keys of the parameters it holds now, wherever they were written from
(torchtitan keeps FQNs stable across parallelisms for the same reason).

What one checkpoint holds (flat DCP keys, one per canonical name -- see runtime/sync.py):
  model.<name>                     the weight
  optim.<state>.<name>             AdamW's step / exp_avg / exp_avg_sq for that weight
  rng.cpu.rank<r>, rng.cuda.rank<r>  each rank's torch RNG states
and meta.json: step, tokens, skipped steps, data position (= step: the batch of step k is a
function of (seed, k)), `data_state` (data.streaming: each source's documents read and its partial
row, the same on every rank; JSON, so a user can read where a run stood), world size, and the
config fingerprint (model: must match; layout and training knobs: may change, a change is reported).
The learning rate is a function of the step.

Copies are written once. A canonical name (a tie group such as GPT-2's wte/lm_head, or a chunk
DualPipe mirrors onto two ranks) may be held by several ranks and several local Parameters; the
lowest rank that holds it (`min(GradSync.holders[name])`, the same owner GradSync.owned() uses
for the gradient norm) contributes its first local copy, every other copy contributes nothing.
On load every rank reads the key into one copy and copies it into the rest.

Atomic: every rank writes into <run_dir>/checkpoints/.step_000123.tmp; after a barrier rank 0
adds meta.json (with the sha256 manifest of every other file, each rank hashing the tensor data
it wrote) and renames the directory to step_000123. A crash at any point leaves either no
step_000123 or a complete one; the newest checkpoint is the highest whole step_* (a damaged one
is reported and passed over: train/checkpoint_dirs.py). checkpoint.keep_last prunes older ones.
The checkpoint phase's collectives (DCP's, the barriers, the manifest, the resume's spread
hashing) run on a gloo group of their own with checkpoint.timeout_s (train/checkpoint_group.py),
so no rank waits on file work inside an NCCL collective.

meta.json's fingerprint and the resume rules: train/checkpoint_meta.py.

What it works on is a `Checkpointable` (the rank's GradSync, optimizer and counters), not the
trainer: the trainer depends on this module, never the other way. Messages for the user go
to the `note` callback the caller passes (the trainer hands them to its loggers).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from pipetrain.config import Config
from pipetrain.config.train import TrainerConfig
from pipetrain.train.checkpoint_dirs import (CKPT_DIR, META, Note, manifest, prune, silent, step_dir)
from pipetrain.train.checkpoint_dcp import planners
from pipetrain.train.checkpoint_group import CheckpointGroup, pick
from pipetrain.train.disk_full import one_line_if_full
from pipetrain.train.checkpoint_meta import FORMAT, check_compatible, fingerprint, read_meta

if TYPE_CHECKING:
    from pipetrain.parallel.parallelize import SplitWeights
    from pipetrain.runtime.sync import GradSync

@dataclass
class TrainState:
    """The counters a checkpoint restores besides the tensors."""

    step: int = 0  # optimizer steps done (= the data position: the batch of step k is a function of k)
    tokens: int = 0
    skipped: int = 0
    decay_steps: int = 0  # the cosine's length the run was started with (optim.decay_steps or trainer.max_steps)
    first_loss: Optional[float] = None  # step 1's loss: a resumed run's done line starts from it
    resumed_at: Optional[int] = None  # the step this process resumed at (not saved)
    # a stateful data source's position after `step` (data.streaming: train/hf_stream.py), taken at each save;
    # None where the batch of step k is a function of (seed, k) alone
    data: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Checkpointable:
    """What one rank saves and restores: its weights with their copies (`sync.local`: canonical
    name -> this rank's Parameters), the optimizer holding their state, and the counters."""

    sync: GradSync
    optimizer: torch.optim.Optimizer
    state: TrainState
    splits: Optional[SplitWeights] = None  # tensor / expert parallel: weights split across ranks (saved unsplit)
    # the checkpoint phase's own gloo group (checkpoint.timeout_s), made at the first resume or save
    comm: CheckpointGroup = field(default_factory=CheckpointGroup, compare=False, repr=False)

    def group(self, config: Optional[Config] = None) -> Optional[dist.ProcessGroup]:
        """Collective on first use: the group the checkpoint phase's collectives run on."""
        return self.comm.get(config.checkpoint.timeout_s if config is not None else None)


def due(step: int, cfg: TrainerConfig) -> bool:
    """Save after optimizer step `step`? Every trainer.ckpt_every steps, and at the end if trainer.ckpt_at_end."""
    return bool(cfg.ckpt_every and step % cfg.ckpt_every == 0) or (cfg.ckpt_at_end and step == cfg.max_steps)


# ---- state dicts ---------------------------------------------------------------------------------


def owned_names(sync: GradSync) -> list[str]:
    """Canonical names this rank writes: those whose lowest holder it is (one writer per key)."""
    return [n for n in sorted(sync.local) if min(sync.holders[n]) == sync.rank]


def _adam_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if optimizer.defaults.get("amsgrad") else ())


def _step_on_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Does AdamW keep `p`'s step on p's device? Fused and capturable do (their kernels read it
    there); the others keep it on the CPU (torch's rule: Optimizer._process_value_according_to_param_policy)."""
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), optimizer.defaults)
    return bool(group.get("fused") or group.get("capturable"))


def _fresh_adam_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state before its first update (torch.optim.adamw._init_group): a step of 0 and zero
    moments. Saving it for a weight that has no state yet is therefore exact. The step is on p's
    device for fused / capturable AdamW, on the CPU otherwise."""
    step = torch.zeros((), dtype=torch.float32, device=p.device if _step_on_device(optimizer, p) else "cpu")
    zeros = {k: torch.zeros_like(p.detach(), memory_format=torch.preserve_format) for k in _adam_keys(optimizer)[1:]}
    return {"step": step, **zeros}


def _optimized(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def _rng_state() -> dict[str, torch.Tensor]:
    rank = world_rank()
    out = {f"rng.cpu.rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.cuda.rank{rank}"] = torch.cuda.get_rng_state()
    return out


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _as_saved(target: Checkpointable, name: str, t: torch.Tensor, *, copy: bool = False) -> Any:
    """What DCP is handed for `t` (the weight of `name` or one of its AdamW tensors): a tp / ep slice
    as its parts of the unsplit tensor (parallel/split_weights.py: LocalParts, views of t, or with
    copy=True of a host copy), anything else (a whole tensor, an FSDP2 DTensor, a step count) as it
    is (an async save's stager copies those)."""
    split = target.splits is not None and name in target.splits.split_names()
    return target.splits.parts(name, t, copy=copy) if split and t.dim() else t.detach()


def save_state_dict(target: Checkpointable, *, copy: bool = False) -> dict[str, Any]:
    """This rank's contribution: the keys it owns (model + optimizer) and its own RNG states.
    Every tp / ep rank owns the same names and offers its own parts of them (no rank gathers
    another's). copy=True (an async save): the parts are of host copies of the slices."""
    sync, opt = target.sync, target.optimizer
    optimized = _optimized(opt)
    out: dict[str, Any] = {}
    for name in owned_names(sync):
        p = sync.local[name][0]
        out[f"model.{name}"] = _as_saved(target, name, p, copy=copy)
        if id(p) in optimized:
            state = opt.state.get(p) or _fresh_adam_state(opt, p)
            out.update({f"optim.{k}.{name}": _as_saved(target, name, state[k], copy=copy) for k in _adam_keys(opt)})
    out.update(_rng_state())
    return out


# ---- save ----------------------------------------------------------------------------------------


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote: meta.json last, then one rename makes the checkpoint visible."""
    with (tmp / META).open("w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(f".{final.name}.old")
    if final.exists():  # saving a step again (a resumed run): swap, never delete first
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def prepare_staging(target: Checkpointable, run_dir: Path, *, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Collective (on `group`): the step's empty temporary directory (rank 0 makes it; a crashed
    save's is replaced)."""
    final = step_dir(run_dir, target.state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    if world_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)
    barrier(group)
    return tmp


def write_staged(target: Checkpointable, run_dir: Path, config: Optional[Config] = None) -> Path:
    """Collective: every rank writes its keys into the step's temporary directory (nothing visible
    yet). The tp gathers of save_state_dict run on the tp group; the rest on the checkpoint group."""
    group = target.group(config)
    tmp = prepare_staging(target, run_dir, group=group)
    state = save_state_dict(target)
    with warnings.catch_warnings():  # P=1 without a process group is intended, not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        import torch.distributed.checkpoint as dcp  # ~0.5 s to import: only runs that save pay it

        dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized(),
                 planner=planners()[0]())
    return tmp


def _manifest(tmp: Path, group: Optional[dist.ProcessGroup]) -> Optional[dict[str, dict[str, Any]]]:
    """Collective, after every rank's files are on disk: each rank hashes the tensor data it wrote
    (DCP names it __<rank>_<n>.distcp), rank 0 gathers them and hashes the rest (.metadata).
    Returns the manifest on rank 0, None elsewhere."""
    mine = manifest(tmp, f"__{world_rank()}_*")
    if not dist.is_initialized():
        return manifest(tmp, known=mine)
    parts: Optional[list[Any]] = [None] * dist.get_world_size() if world_rank() == 0 else None
    dist.gather_object(mine, parts, group=group, group_dst=0)
    if parts is None:
        return None
    return manifest(tmp, known={k: v for part in parts for k, v in part.items()})


def commit_staged(tmp: Path, st: TrainState, run_dir: Path, config: Config, *, note: Note = silent,
                  group: Optional[dist.ProcessGroup] = None) -> Path:
    """Collective (on `group`, the checkpoint group: rank 0's file work below runs while the others
    wait under checkpoint.timeout_s), once every rank's files of `tmp` are on disk: the manifest,
    meta.json (last) and the rename that makes the checkpoint of step st.step visible; then
    checkpoint.keep_last."""
    final = step_dir(run_dir, st.step)
    files = _manifest(tmp, group)
    if world_rank() == 0:
        meta = {"format": FORMAT, "step": st.step, "tokens": st.tokens, "skipped": st.skipped,
                "decay_steps": st.decay_steps, "first_loss": st.first_loss,
                "data_position": st.step, **({"data_state": st.data} if st.data is not None else {}),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
                "fingerprint": fingerprint(config), "files": files}
        _commit(tmp, final, meta)
        prune(run_dir, config.checkpoint.keep_last, note=note)
    barrier(group)  # no rank goes on (or exits) before the checkpoint is visible
    return final


def save_checkpoint(target: Checkpointable, run_dir: Path, config: Config, *, note: Note = silent) -> Path:
    """Collective: save after the current step (target.state.step); returns the committed directory.
    meta.json, written last, carries the manifest of every other file (train/checkpoint_dirs.py).
    A full disk raises DiskFull (one line) instead of DCP's every-rank traceback."""
    t0 = time.perf_counter()
    group = target.group(config)
    with one_line_if_full(target.state.step, run_dir, rank=world_rank()):
        tmp = write_staged(target, run_dir, config)
        barrier(group)  # every rank's files are on disk
        final = commit_staged(tmp, target.state, run_dir, config, note=note, group=group)
    if world_rank() == 0:
        note(f"checkpoint: saved {final} ({time.perf_counter() - t0:.2f} s)")
    return final


# ---- load ----------------------------------------------------------------------------------------


def _load_targets(target: Checkpointable, available: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Tensors DCP reads into: one per canonical name this rank holds (not only the owned ones)."""
    sync, opt = target.sync, target.optimizer
    optimized = _optimized(opt)
    targets: dict[str, Any] = {}
    adam: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(sync.local):
        p = sync.local[name][0]
        # read into the weight itself; a tp / ep slice reads just its parts of the unsplit tensor
        targets[f"model.{name}"] = _as_saved(target, name, p)
        if id(p) in optimized:
            adam[name] = _fresh_adam_state(opt, p)
            targets.update({f"optim.{k}.{name}": _as_saved(target, name, t) for k, t in adam[name].items()})
    missing = sorted(k for k in targets if k not in available)
    if missing:
        raise ValueError(f"trainer.resume: the checkpoint lacks {len(missing)} key(s) this run needs "
                         f"(first: {missing[0]}): it was saved for another model; start a new run (a new run.name)")
    targets.update({k: torch.empty_like(v) for k, v in _rng_state().items() if k in available})
    return targets, adam


def load_checkpoint(target: Checkpointable, path: Path, config: Config, *, note: Note = silent) -> dict[str, Any]:
    """Collective: load `path` into the target (every local copy, optimizer state, RNG, step)."""
    path = Path(path)
    meta = read_meta(path)
    notes = check_compatible(meta, config, path)
    import torch.distributed.checkpoint as dcp

    available = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    targets, adam = _load_targets(target, available)
    with warnings.catch_warnings():  # P=1 without a process group is intended, not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, checkpoint_id=path, process_group=target.group(config), no_dist=not dist.is_initialized(),
                 planner=planners()[1]())
    _restore(target, targets, adam)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > meta["world_size"]:  # RNG states are per rank; the data position is the step
        notes.append(f"saved by {meta['world_size']} rank(s): ranks {meta['world_size']}..{world - 1} "
                     f"keep their seeded RNG state")
    st = target.state
    st.step, st.tokens, st.skipped = meta["step"], meta["tokens"], meta.get("skipped", 0)
    # checkpoints from before optim.decay_steps: their cosine ended at their trainer.max_steps
    st.decay_steps = meta.get("decay_steps") or meta["fingerprint"]["training"].get("trainer.max_steps", 0)
    st.first_loss, st.resumed_at, st.data = meta.get("first_loss"), st.step, meta.get("data_state")
    for n in notes:
        note(f"checkpoint: {n}")
    return meta


def _restore(target: Checkpointable, targets: dict[str, torch.Tensor], adam: dict[str, dict]) -> None:
    """The loaded tensors into the target (the first copy of each weight was read in place): every
    other local copy, AdamW's state, RNG."""
    sync, opt = target.sync, target.optimizer
    with torch.no_grad():
        for copies in sync.local.values():
            for p in copies[1:]:
                p.copy_(copies[0])
    for name, state in adam.items():  # every copy gets its own tensors: AdamW updates them in place
        for i, p in enumerate(sync.local[name]):
            opt.state[p] = {k: _state_copy(target, t, p, first=i == 0) for k, t in state.items()}
    for key, t in targets.items():
        if key.startswith("rng.cpu."):
            torch.set_rng_state(t)
        elif key.startswith("rng.cuda."):
            torch.cuda.set_rng_state(t)


def _state_copy(target: Checkpointable, t: torch.Tensor, p: torch.Tensor, *, first: bool) -> torch.Tensor:
    """A loaded optimizer tensor for parameter `p`: the tensor read for its first copy, a clone for
    each other. The step goes where torch's own load_state_dict puts it (fp32 on p's device for
    fused / capturable AdamW, as it was otherwise), whatever tensor it was read into."""
    if not t.dim() and _step_on_device(target.optimizer, p):
        return t.to(dtype=torch.float32, device=p.device, copy=True)
    return t if first else t.clone()


def resume(target: Checkpointable, run_dir: Path, config: Config, *, note: Note = silent,
           restarted: bool = False) -> Optional[Path]:
    """Load what trainer.resume names (collective), or start fresh; returns the checkpoint loaded.
    restarted=True (a worker group torch elastic restarted): the newest good checkpoint of the run
    directory first, whatever trainer.resume says; trainer.resume's own only when there is none."""
    want = config.trainer.resume
    # rank 0 picks (its listing is the one every rank loads), every rank hashes a share of the bytes
    path = pick(want, run_dir, restarted=restarted, group=target.group(config), note=note)
    if path is None:  # a new run directory (trainer.resume=auto, the default) has nothing to say
        if restarted or (want == "auto" and (Path(run_dir) / CKPT_DIR).exists()):
            note(f"checkpoint: no checkpoint in {Path(run_dir) / CKPT_DIR}, starting fresh")
        return None
    meta = load_checkpoint(target, path, config, note=note)
    note(f"checkpoint: resumed from {path} at step {meta['step']}")
    return path
