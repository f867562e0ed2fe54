"""Before a resume the checkpoint's bytes are hashed by every rank, each its share (F6 of the
CUDA/NCCL review: rank 0 alone hashed the whole checkpoint while the others waited in an NCCL
collective under its 300 s watchdog).

Two checkpoints of made-up files (DCP's names, meta.json with the manifest) and 3 real gloo
ranks calling train/checkpoint_group.pick with a `read` that records what each rank hashed:
every file is read by exactly one rank, each rank reads its share and about a third of the
bytes; a changed file that rank 0 never reads is still found by name, the previous checkpoint
used (rank 0 reports it); a damaged checkpoint named explicitly is refused in one line on every rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _dist import spawn
from pipetrain.train import checkpoint_dirs as dirs

WORLD = 3
SIZES = {".metadata": 3000, "__0_0.distcp": 40000, "__1_0.distcp": 30000, "__2_0.distcp": 35000,
         "__3_0.distcp": 20000, "__4_0.distcp": 25000}


def make_checkpoint(run: Path, step: int) -> Path:
    path = dirs.step_dir(run, step)
    path.mkdir(parents=True)
    for name, size in SIZES.items():
        (path / name).write_bytes(os.urandom(size))
    meta = {"format": 1, "step": step, "tokens": 0, "world_size": WORLD, "fingerprint": {},
            "files": dirs.manifest(path)}
    (path / dirs.META).write_text(json.dumps(meta))
    return path


def pick_on_every_rank(rank: int, world: int, out: Path, run: Path, cases: dict[str, str]) -> None:
    from pipetrain.train.checkpoint_group import pick

    result = {}
    for case, want in cases.items():
        reads: list[str] = []
        notes: list[str] = []

        def read(path: Path, reads: list[str] = reads) -> str:  # this case's list, bound now
            reads.append(f"{path.parent.name}/{path.name}")
            return dirs.sha256(path)

        try:
            got = pick(want, run, note=notes.append, read=read)
            result[case] = {"path": None if got is None else got.name, "reads": reads, "notes": notes}
        except ValueError as e:
            result[case] = {"error": str(e), "reads": reads, "notes": notes}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.dist
def test_resume_hashing_is_spread_and_damage_still_found(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 2)
    step4 = make_checkpoint(run, 4)
    share = dirs.share(dirs.read_meta_checked(step4)[0]["files"], WORLD)
    assert all(share) and sorted(sum(share, [])) == sorted(SIZES)
    victim = share[2][0]  # a file rank 2 hashes, rank 0 never
    whole = {"whole": "auto"}
    spawn(pick_on_every_rank, WORLD, tmp_path / "whole", run, whole)
    flip(step4 / victim)
    damaged = {"auto": "auto", "named": str(step4)}
    spawn(pick_on_every_rank, WORLD, tmp_path / "damaged", run, damaged)

    ranks = [json.loads((tmp_path / "whole" / f"rank{r}.json").read_text())["whole"] for r in range(WORLD)]
    assert {r["path"] for r in ranks} == {"step_000004"}
    for r, res in enumerate(ranks):
        assert res["reads"] == [f"step_000004/{n}" for n in share[r]], (r, res["reads"])
        read_bytes = sum(SIZES[n.split("/")[1]] for n in res["reads"])
        assert read_bytes < 0.5 * sum(SIZES.values()), (r, read_bytes)  # rank 0 read them all before

    ranks = [json.loads((tmp_path / "damaged" / f"rank{r}.json").read_text()) for r in range(WORLD)]
    why = f"{victim} does not match its sha256 in the manifest"
    assert {r["auto"]["path"] for r in ranks} == {"step_000002"}
    assert len(ranks[0]["auto"]["notes"]) == 1 and f"step_000004 is damaged ({why}" in ranks[0]["auto"]["notes"][0]
    assert "resuming from step_000002" in ranks[0]["auto"]["notes"][0]
    assert f"step_000004/{victim}" in ranks[2]["auto"]["reads"]
    assert not any(n.endswith(victim) and n.startswith("step_000004") for n in ranks[0]["auto"]["reads"])
    for res in ranks:  # named explicitly: refused on every rank, in one line
        text = res["named"]["error"]
        assert text.startswith(f"trainer.resume={step4}: step_000004 is damaged ({why}") and "\n" not in text


@pytest.mark.pure
def test_share_balances_bytes_and_covers_every_file_once():
    files = {n: {"bytes": b, "sha256": ""} for n, b in SIZES.items()}
    for world in (1, 2, 3, 8):
        parts = dirs.share(files, world)
        assert len(parts) == world and sorted(sum(parts, [])) == sorted(SIZES)
        loads = [sum(SIZES[n] for n in p) for p in parts]
        assert max(loads) - min(loads) <= max(SIZES.values()), loads  # greedy: within one file
        assert all(p == sorted(p, key=dirs.check_order) for p in parts)


@pytest.mark.pure
def test_checkpoint_timeout_must_be_positive():
    from pipetrain.config.run import CheckpointConfig

    assert CheckpointConfig().timeout_s >= 1800  # well past NCCL's 300 s default watchdog
    with pytest.raises(ValueError, match=r"^checkpoint.timeout_s must be > 0 seconds \(got 0\)") as err:
        CheckpointConfig(timeout_s=0)
    assert "\n" not in str(err.value)
