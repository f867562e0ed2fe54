"""`pipetrain data=datasets data.path=DIR` trains, as a user runs it, on a `save_to_disk` folder and on
a hub-layout folder (parquet under data/), both written by `datasets` itself (#46); and ranks that start
together tokenize the source once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import run_cli

datasets = pytest.importorskip("datasets")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DOCS = [f"document {i}: the pipeline trains on documents packed into rows. " * (1 + i % 3) for i in range(200)]


@pytest.mark.parametrize("layout", ["save_to_disk", "hub-layout"])
def test_pipetrain_trains_on_a_datasets_folder(tmp_path, layout):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    folder = tmp_path / "corpus"
    if layout == "save_to_disk":
        ds.save_to_disk(folder)
    else:
        (folder / "data").mkdir(parents=True)
        ds.to_parquet(folder / "data" / "train-00000-of-00001.parquet")
    res = run_cli(["data=datasets", f"data.path={folder}", "trainer.max_steps=2", "trainer.ckpt_at_end=false",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                  env_extra={"HF_DATASETS_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done: 2 steps" in res.stdout + res.stderr
    assert len(list((tmp_path / "cache" / "pipetrain-packed").glob("*/train.bin"))) == 1  # tokenized once


def test_a_missing_field_fails_before_any_rank_starts(tmp_path):
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(tmp_path / "corpus")
    res = run_cli(["data=datasets", f"data.path={tmp_path / 'corpus'}", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(err) == 1 and "'text'" in err[0] and "fields: body" in err[0], res.stderr


def test_ranks_started_together_tokenize_once_and_read_the_same_stream(tmp_path):
    """Four processes (as four ranks) open the same source at once: one builds under the lock, all read it."""
    cache = tmp_path / "cache"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "corpus")
    path = tmp_path / "corpus"
    code = ("import sys, hashlib, numpy as np; from pipetrain.config.data import DataConfig; "
            "from pipetrain.train.hf_build import build_hf_data; "
            f"c = DataConfig(name='datasets', path={str(path)!r}, batch_size=4, seq_len=16, tokenizer='byte'); "
            "s = build_hf_data(c, seed=0, vocab_size=256); "
            "print(hashlib.sha256(np.asarray(s.parts['train']).tobytes()).hexdigest())")
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
    assert [p.name for p in (cache / "pipetrain-packed").iterdir() if p.is_dir()] == [
        p.name for p in (cache / "pipetrain-packed").glob("*") if (p / "meta.json").is_file()]  # no .partial left
