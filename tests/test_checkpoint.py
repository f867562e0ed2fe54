"""Checkpoints on real gloo processes: resume repeats the uninterrupted run, across layouts too.

One reference run (P=2, 1F1B, GPT-2 tiny, 6 steps, a checkpoint every 3 steps) gives the
losses every resumed run must repeat:
  - same degree and schedule, fresh processes, trainer.resume=auto from step 3: bitwise the
    same losses, weights and optimizer state at step 6;
  - P=4 ZB-V and P=2 DualPipe (mirrored copies) resuming the P=2 1F1B checkpoint: within 1e-4;
    DualPipe's own checkpoint writes each key once, from the lowest rank holding it;
  - a save that died between writing and committing leaves the previous checkpoint the newest;
  - a bad trainer.resume is one line naming trainer.resume.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from _dist import spawn
from pipetrain.launch import launch
from pipetrain.plan import make_plan
from pipetrain.train import checkpoint as ckpt
from pipetrain.train import checkpoint_dirs as dirs
from pipetrain.train import checkpoint_meta

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, EVERY = 6, 3
BASE = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        f"trainer.max_steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=0", "trainer.device=cpu"]
LAYOUTS = {"1f1b-P2": ["pipeline.degree=2", "schedule=1f1b"],
           "zbv-P4": ["pipeline.degree=4", "schedule=zbv"],
           "dualpipe-P2": ["pipeline.degree=2", "schedule=dualpipe"],
           # data parallel: the same global batch of 4 in 2 pipelines x 2 microbatches
           "shard2-P1": ["pipeline.degree=1", "parallel.dp_shard=2", "pipeline.microbatches=2"],
           "replicate2-P2": ["pipeline.degree=2", "parallel.dp_replicate=2", "pipeline.microbatches=2"]}
WORLD = {"1f1b-P2": 2, "zbv-P4": 4, "dualpipe-P2": 2, "shard2-P1": 2, "replicate2-P2": 4}


def crash_mid_save(rank: int, world: int, out: Path, config, plan, run_dir: Path) -> None:
    """Resume, train one step, write the step's checkpoint files, die before the commit."""
    from pipetrain.train.trainer import Trainer

    trainer = Trainer(config, plan, run_dir)
    trainer.resume()
    (out / f"resumed{rank}.txt").write_text(str(trainer.state.step))
    trainer.train_step()
    ckpt.write_staged(trainer.checkpointable, trainer.run_dir)
    os._exit(0)  # killed: no commit, no cleanup, no atexit


def train(compose, run_dir: Path, layout: str, *extra: str, fn=None) -> Path:
    """Train as `pipetrain` would: pipetrain.launch (launch/agent.py) runs the trainer on every rank.
    With `fn`, spawn plain ranks running fn instead (a crash test needs ranks that die mid-save)."""
    config = compose([*BASE, *LAYOUTS[layout], *extra])
    if fn is None:
        launch(config, make_plan(config), run_dir)
    else:
        spawn(fn, config.layout.world, run_dir / "spawn", config, make_plan(config), run_dir)
    return run_dir


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows}


def tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp / "flat.pt")
    return torch.load(tmp / "flat.pt")


def seed_run(reference: Path, run_dir: Path, step: int) -> Path:
    """A new run directory holding only the reference's checkpoint of `step`."""
    shutil.copytree(dirs.step_dir(reference, step), dirs.step_dir(run_dir, step))
    return run_dir


@pytest.fixture(scope="module")
def reference(compose, tmp_path_factory) -> Path:
    """The uninterrupted run: 6 steps at P=2 1F1B, checkpoints at steps 3 and 6."""
    return train(compose, tmp_path_factory.mktemp("reference"), "1f1b-P2", f"trainer.ckpt_every={EVERY}")


def test_reference_checkpoints_and_meta(reference):
    assert [s for s, _ in dirs.list_checkpoints(reference / "checkpoints")] == [3, 6]
    meta = checkpoint_meta.read_meta(dirs.step_dir(reference, 3))
    assert (meta["step"], meta["data_position"], meta["tokens"], meta["world_size"]) == (3, 3, 3 * 4 * 32, 2)
    assert meta["fingerprint"]["layout"]["schedule.name"] == "1f1b"
    assert meta["fingerprint"]["model"]["model.n_layer"] == 8
    assert not list((reference / "checkpoints").glob(".*"))  # no temporary directory left


def test_resume_same_layout_is_bitwise(compose, reference, tmp_path):
    run = train(compose, seed_run(reference, tmp_path / "run", EVERY), "1f1b-P2", "trainer.resume=auto")
    ref, got = losses(reference), losses(run)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in got] == [ref[s] for s in got]  # bitwise: == on floats
    a = tensors(dirs.step_dir(reference, STEPS), tmp_path)
    b = tensors(dirs.step_dir(run, STEPS), tmp_path)
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert checkpoint_meta.read_meta(dirs.step_dir(run, STEPS))["tokens"] == STEPS * 4 * 32


@pytest.mark.parametrize("layout", ["zbv-P4", "dualpipe-P2", "shard2-P1", "replicate2-P2"])
def test_resume_other_layout_within_1e4(compose, reference, tmp_path, layout):
    src = dirs.step_dir(reference, EVERY)
    run = train(compose, tmp_path / "run", layout, f"trainer.resume={src}")
    ref, got = losses(reference), losses(run)
    assert sorted(got) == [4, 5, 6]
    for s in got:
        assert abs(got[s] - ref[s]) < 1e-4, (s, got[s], ref[s])
    # The new layout's own checkpoint holds the same keys (one per unsplit name), each written
    # exactly once, by the lowest rank holding it (DualPipe P=2: both ranks hold every chunk).
    path = dirs.step_dir(run, STEPS)
    md = dcp.FileSystemReader(path).read_metadata()
    ref_keys = set(dcp.FileSystemReader(dirs.step_dir(reference, STEPS)).read_metadata().state_dict_metadata)
    keys = set(md.state_dict_metadata)
    assert keys - {f"rng.cpu.rank{r}" for r in range(WORLD[layout])} == ref_keys - {"rng.cpu.rank0", "rng.cpu.rank1"}
    writers: dict[str, list[str]] = {}
    for index, info in md.storage_data.items():
        writers.setdefault(index.fqn, []).append(info.relative_path)
    if layout == "shard2-P1":  # FSDP2: a matrix's two halves come from its two shards
        assert len(writers["model.layers.1.attn.c_attn.weight"]) == 2
        return
    # replicas write each key once (DCP drops the duplicates)
    assert all(len(files) == 1 for files in writers.values())
    if layout == "dualpipe-P2":
        assert {writers[k][0] for k in keys if not k.startswith("rng.")} == {"__0_0.distcp"}
        assert writers["rng.cpu.rank1"] == ["__1_0.distcp"]


def test_crash_mid_save_keeps_previous_checkpoint(compose, reference, tmp_path):
    run = seed_run(reference, tmp_path / "run", EVERY)
    root = run / "checkpoints"
    (root / "step_000099").mkdir()  # a directory without meta.json is not a checkpoint
    train(compose, run, "1f1b-P2", "trainer.resume=auto", fn=crash_mid_save)
    assert (run / "spawn" / "resumed0.txt").read_text() == "3"
    staged = root / ".step_000004.tmp"
    assert (staged / ".metadata").is_file() and not (staged / dirs.META).exists()
    assert dirs.newest_checkpoint(run) == dirs.step_dir(run, EVERY)
    # The next run resumes from step 3 again and saves step 4 over the dead save's leftovers.
    train(compose, run, "1f1b-P2", "trainer.resume=auto", "trainer.max_steps=4")
    assert dirs.newest_checkpoint(run) == dirs.step_dir(run, 4)
    assert not staged.exists()
    assert losses(run) == {4: losses(reference)[4]}  # step 4's loss comes before its update


def test_resume_errors_are_one_line(compose, reference, tmp_path):
    with pytest.raises(ValueError) as err:
        dirs.resolve_resume(str(tmp_path / "nope"), tmp_path)
    assert str(err.value).startswith("trainer.resume=") and "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^trainer.resume=.*not a complete checkpoint") as err:
        dirs.resolve_resume(str(tmp_path / "empty"), tmp_path)
    assert "\n" not in str(err.value)
    assert dirs.resolve_resume("auto", tmp_path) is None  # nothing yet: start fresh
    assert dirs.resolve_resume(None, tmp_path) is None
    assert dirs.resolve_resume(str(reference), tmp_path) == dirs.step_dir(reference, STEPS)  # a run dir: newest
    path = dirs.step_dir(reference, EVERY)
    meta = checkpoint_meta.read_meta(path)
    with pytest.raises(ValueError, match=r"^trainer.resume: .*model.n_layer: 8 -> 4") as err:
        checkpoint_meta.check_compatible(meta, compose([*BASE, "model.n_layer=4"]), path)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^trainer.resume: .*model.n_layer: 8 -> 4"):
        checkpoint_meta.preflight(compose([*BASE, "model.n_layer=4", f"trainer.resume={path}"]), tmp_path)
    resumed = checkpoint_meta.preflight(compose([*BASE, "trainer.resume=auto"]), reference)
    assert resumed == dirs.step_dir(reference, STEPS)
    notes = checkpoint_meta.check_compatible(meta, compose([*BASE, *LAYOUTS["zbv-P4"], "trainer.seed=7"]), path)
    assert any("pipeline.degree: 2 -> 4" in n for n in notes) and any("trainer.seed" in n for n in notes)
