"""`pipetrain mode=eval data=datasets data.path=P` (issue #46): every held-out validation row once, with
document masks, the mean loss over every counted target. Run as a user runs it, at pp=2 and at cp=2 with
the K/V ring, against the seeded model in one process running each document of each validation row alone;
the masks matter (the same rows causal over the whole row give another loss)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli
from test_document_mask_cp_train import short_documents
from pipetrain.models.causal_lm import IGNORE_INDEX

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BASE = ["mode=eval", "model=llama-tiny", "data=datasets", "data.seq_len=16", "data.batch_size=4",
        "pipeline.microbatches=2", "data.val_fraction=0.2", "trainer.device=cpu"]
CASES = {"pp2": ["pipeline.degree=2"], "cp2-ring": ["pipeline.degree=1", "parallel.cp=2", "parallel.cp_rotate=ring"]}


def one_process(config) -> tuple[float, float, int]:
    """(each document alone, whole rows causal, counted targets) over every validation row."""
    from pipetrain.models.split import split_model
    from pipetrain.plan import build_model
    from pipetrain.runtime.documents import documents
    from pipetrain.train.evaluate import validation_rows
    from pipetrain.train.pipeline import document_eos

    (src,) = validation_rows(config.data, seed=config.trainer.seed, vocab_size=config.model.vocab_size)
    model = build_model(config.model, device="meta")
    (stage,) = split_model(model, [range(len(model.layers))], seed=config.trainer.seed)
    eos = document_eos(config.data)
    x, y, _ = src.rows("val", torch.arange(src.num_rows("val")).numpy())
    alone, causal = [], []
    with torch.no_grad():
        causal = stage(x)
        d = documents(x, eos)
        for b in range(x.size(0)):
            alone.append(torch.cat([stage(x[b:b + 1, d.index[b] == i]) for i in range(int(d.index[b].max()) + 1)], 1))
    loss = [F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).item()
            for out in (torch.cat(alone), causal)]
    return loss[0], loss[1], int((y != IGNORE_INDEX).sum())


@pytest.mark.parametrize("case", list(CASES))
def test_eval_on_datasets_is_each_documents_mean_loss(case, compose, tmp_path, monkeypatch):
    short_documents(tmp_path / "docs.jsonl")
    env = {"HF_DATASETS_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"])
    args = [*BASE, *CASES[case], f"data.path={tmp_path / 'docs.jsonl'}"]
    res = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env_extra=env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads((tmp_path / "run" / "eval.json").read_text())
    want, causal, counted = one_process(compose(args))
    assert got["document_mask"] and got["split"] == "held out"
    assert got["tokens"] == counted and got["rows"] * 16 == counted  # packed rows: every target counts
    assert abs(got["loss"] - want) < 1e-5, (got["loss"], want)
    assert abs(causal - want) > 5e-5  # several documents a row: the masks move the loss by 5x the tolerance
