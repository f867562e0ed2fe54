"""Damaged checkpoints on real files: each damage is found by name and why, the previous good
checkpoint is used (trainer.resume=auto), or the run refuses in one line (an explicit path).

One real run (P=2 gloo ranks, GPT-2 tiny, 4 steps, a checkpoint every 2) gives the checkpoints;
each case copies them and damages step 4 the way the issue lists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipetrain.launch import launch
from pipetrain.plan import make_plan
from pipetrain.train import checkpoint as ckpt
from pipetrain.train import checkpoint_dirs as dirs

pytestmark = pytest.mark.dist

BASE = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.device=cpu", "logger=[jsonl]"]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip64(path: Path) -> None:
    """64 bytes changed in the middle of a shard (tensor data: the file is almost all tensors)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes((b ^ 0x5A) for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def _no_fingerprint(path: Path) -> None:
    meta = json.loads(path.read_text())
    del meta["fingerprint"]
    path.write_text(json.dumps(meta))


def _manifest_entry_without(path: Path, key: str) -> None:
    meta = json.loads(path.read_text())
    del meta["files"]["__1_0.distcp"][key]
    path.write_text(json.dumps(meta))


def _empty(step: Path) -> None:
    shutil.rmtree(step)
    step.mkdir()


# name -> (what to do to step_000004, a phrase of the reason, found by sizes alone?)
DAMAGE = {
    "truncated distcp": (lambda d: _truncate(d / "__1_0.distcp"), "__1_0.distcp has", True),
    "deleted shard": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing", True),
    "64 bytes changed": (lambda d: _flip64(d / "__0_0.distcp"), "__0_0.distcp does not match its sha256", False),
    "garbage meta.json": (lambda d: (d / "meta.json").write_text("}{ not json"), "meta.json is not valid JSON", True),
    "truncated .metadata": (lambda d: _truncate(d / ".metadata"), ".metadata has", True),
    "deleted .metadata": (lambda d: (d / ".metadata").unlink(), "no .metadata", True),
    "empty step dir": (_empty, "empty directory", True),
    "meta.json without fingerprint": (lambda d: _no_fingerprint(d / "meta.json"), "lacks 'fingerprint'", True),
    "manifest entry without bytes": (lambda d: _manifest_entry_without(d / "meta.json", "bytes"),
                                     "manifest entry for __1_0.distcp lacks 'bytes'", True),
    "manifest entry without sha256": (lambda d: _manifest_entry_without(d / "meta.json", "sha256"),
                                      "manifest entry for __1_0.distcp lacks 'sha256'", True),
}


@pytest.fixture(scope="module")
def reference(compose, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    config = compose(BASE)
    launch(config, make_plan(config), run)
    return run


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def damaged_copy(reference: Path, tmp_path: Path, case: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run / "checkpoints")
    DAMAGE[case][0](dirs.step_dir(run, 4))
    return run


def test_manifest_lists_every_file_with_its_hash(reference):
    path = dirs.step_dir(reference, 4)
    files = ckpt.read_meta(path)["files"]
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name != "meta.json")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
    assert all(len(v["sha256"]) == 64 and v["bytes"] == (path / k).stat().st_size for k, v in files.items())
    assert dirs.damage(path) is None


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_found_and_the_previous_checkpoint_used(reference, tmp_path, case):
    run = damaged_copy(reference, tmp_path, case)
    _, phrase, by_size = DAMAGE[case]
    step4 = dirs.step_dir(run, 4)
    why = dirs.damage(step4)
    assert why is not None and phrase in why, why
    assert (dirs.damage(step4, deep=False) is None) is not by_size  # byte changes need the hashes
    notes: list[str] = []
    assert dirs.resolve_resume("auto", run, deep=True, note=notes.append) == dirs.step_dir(run, 2)
    assert len(notes) == 1 and "step_000004 is damaged" in notes[0] and phrase in notes[0]
    assert "resuming from step_000002" in notes[0]
    with pytest.raises(ValueError) as err:  # asked for by name: refused in one line
        dirs.resolve_resume(str(step4), run, deep=True)
    text = str(err.value)
    assert text.startswith(f"trainer.resume={step4}: step_000004 is damaged") and phrase in text and "\n" not in text


def test_every_checkpoint_damaged_refuses(reference, tmp_path):
    run = damaged_copy(reference, tmp_path, "deleted shard")
    (dirs.step_dir(run, 2) / "meta.json").write_text("")
    with pytest.raises(ValueError, match=r"^trainer.resume: no whole checkpoint in .*step_000004 is damaged.*"
                                         r"step_000002 is damaged.*move them away, or use a new run.name"):
        dirs.resolve_resume("auto", run, deep=True)


@pytest.mark.slow
def test_resume_passes_over_changed_tensor_bytes(compose, reference, tmp_path, capfd):
    """The silent case of the issue (64 bytes changed load without a word): the run reports
    step_000004 and resumes from step 2, repeating the reference's losses bitwise."""
    run = damaged_copy(reference, tmp_path, "64 bytes changed")
    config = compose([*BASE, "trainer.resume=auto", "logger=[console,jsonl]"])
    launch(config, make_plan(config), run)
    out = capfd.readouterr().out
    assert "step_000004 is damaged (__0_0.distcp does not match its sha256" in out, out[-3000:]
    assert "resumed from" in out and "step_000002 at step 2" in out
    ref, got = losses(reference), losses(run)
    assert sorted(got) == [3, 4] and all(got[s] == ref[s] for s in got)
    assert dirs.damage(dirs.step_dir(run, 4)) is None  # step 4 saved again, whole


@pytest.mark.slow
def test_keep_last_prunes_older_checkpoints(compose, tmp_path):
    run = tmp_path / "run"
    config = compose([*BASE, "trainer.max_steps=5", "trainer.ckpt_every=1", "checkpoint.keep_last=2"])
    launch(config, make_plan(config), run)
    assert [s for s, _ in dirs.step_dirs(run / "checkpoints")] == [4, 5]


def test_prune_never_deletes_the_newest_good_one(reference, tmp_path):
    run = damaged_copy(reference, tmp_path, "deleted shard")  # step 4 damaged, step 2 the newest good
    assert dirs.prune(run, 1) == []
    assert [s for s, _ in dirs.step_dirs(run / "checkpoints")] == [2, 4]
    for step in (1, 0):  # two older good ones: both go, step 2 stays
        shutil.copytree(dirs.step_dir(reference, 2), dirs.step_dir(run, step))
    assert [p.name for p in dirs.prune(run, 1)] == ["step_000000", "step_000001"]
    assert dirs.resolve_resume("auto", run) == dirs.step_dir(run, 2)


@pytest.mark.slow
def test_async_save_writes_the_same_checkpoints(compose, reference, tmp_path, capfd):
    """checkpoint.async_save: training goes on during the write (step 3 updates the weights while
    step 2's files are written), yet each checkpoint holds its own step's tensors, bitwise, and
    is committed with its manifest; the console says how long each save blocked training."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    run = tmp_path / "run"
    config = compose([*BASE, "checkpoint.async_save=true", "logger=[console,jsonl]"])
    launch(config, make_plan(config), run)
    out = capfd.readouterr().out
    assert "checkpoint: saving step_000002 in the background (blocked training" in out, out[-2000:]
    assert f"checkpoint: saved {dirs.step_dir(run, 2).resolve()} (blocked training" in out
    assert losses(run) == losses(reference)
    for step in (2, 4):
        assert dirs.damage(dirs.step_dir(run, step)) is None
        dcp_to_torch_save(dirs.step_dir(run, step), tmp_path / "a.pt")
        dcp_to_torch_save(dirs.step_dir(reference, step), tmp_path / "b.pt")
        a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), step
    assert not list((run / "checkpoints").glob(".*"))


@pytest.mark.slow
def test_slurm_requeued_job_resumes_by_itself(compose, reference, tmp_path, monkeypatch, capfd):
    """A job SLURM requeued (SLURM_RESTART_COUNT, as submitit's requeue leaves it) resumes from its
    run directory's newest good checkpoint even without trainer.resume=auto."""
    run = tmp_path / "run"
    shutil.copytree(dirs.step_dir(reference, 2), dirs.step_dir(run, 2))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    config = compose([*BASE, "logger=[console,jsonl]"])
    launch(config, make_plan(config), run)
    out = capfd.readouterr().out
    assert "requeued by SLURM (1x)" in out and f"resumed from {dirs.step_dir(run, 2).resolve()} at step 2" in out
    assert losses(run) == {s: loss for s, loss in losses(reference).items() if s > 2}
