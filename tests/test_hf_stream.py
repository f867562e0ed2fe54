"""data.streaming=true: documents read through `datasets` streaming and packed as they are read. The rows
are the source's packed stream in order, the position survives a JSON round trip (as a checkpoint's
meta.json holds it) and a reader restored at step 7 repeats the uninterrupted reader's batches; a
mixture streams at its weights; held-out documents never reach training (#46)."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.config.data import DataConfig
from pipetrain.config.data_sources import streams
from pipetrain.metrics import names
from pipetrain.train.data import build_data
from pipetrain.train.hf_stream import StreamRows, held_out
from pipetrain.train.tokenizer import BYTE_EOS

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.pure

DOCS = [f"doc {i}: " + "words " * (i % 11) for i in range(90)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def jsonl(path: Path, docs: list[str]) -> Path:
    datasets.Dataset.from_dict({"text": docs}).to_json(path)
    return path


def config(path, **knobs) -> DataConfig:
    return DataConfig(name="datasets", path=str(path), **{"batch_size": 4, "seq_len": 16, "tokenizer": "byte",
                                                          "streaming": True, "val_fraction": 0.0, **knobs})


def test_rows_are_the_sources_packed_stream_in_order_across_epochs(tmp_path):
    src = build_data(config(jsonl(tmp_path / "d.jsonl", DOCS)), seed=0, vocab_size=256)
    assert isinstance(src, StreamRows)
    stream = np.asarray([t for d in DOCS for t in (*d.encode(), BYTE_EOS)])
    steps = 2 * len(stream) // (4 * 17) + 3  # past the end: the second epoch continues the stream
    rows = []
    for k in range(steps):
        x, y = src.batch(k)
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows += [torch.cat([x[r], y[r, -1:]]).tolist() for r in range(4)]
    got = np.asarray(rows).ravel()
    twice = np.concatenate([stream, stream, stream])[: len(got)]
    assert np.array_equal(got, twice)
    assert src.state_dict()["sources"][0]["epoch"] >= 1


def test_a_reader_restored_at_step_7_repeats_the_uninterrupted_batches(tmp_path):
    web, code = jsonl(tmp_path / "web.jsonl", DOCS), jsonl(tmp_path / "code.jsonl", [d.upper() for d in DOCS[:30]])
    cfg = DataConfig(name="datasets", sources=[{"path": str(web), "weight": 0.7}, {"path": str(code), "weight": 0.3}],
                     batch_size=4, seq_len=16, tokenizer="byte", streaming=True, val_fraction=0.1)
    whole = build_data(cfg, seed=2, vocab_size=256)
    want = [whole.batch(k) for k in range(20)]
    stopped = build_data(cfg, seed=2, vocab_size=256)
    for k in range(7):
        stopped.batch(k)
    saved = json.loads(json.dumps(stopped.state_dict()))  # as meta.json holds it
    assert saved["next_step"] == 7 and [s["name"] for s in saved["sources"]] == ["web", "code"]
    resumed = build_data(cfg, seed=2, vocab_size=256)
    resumed.load_state_dict(saved)
    for k in range(7, 20):  # into the small source's second epoch
        x, y = resumed.batch(k)
        assert torch.equal(x, want[k][0]) and torch.equal(y, want[k][1]), k
    with pytest.raises(RuntimeError, match="in order"):
        resumed.batch(3)


def test_held_out_documents_never_reach_training(tmp_path):
    docs = [f"<{i:03d}>" + "x" * 20 for i in range(200)]
    src = build_data(config(jsonl(tmp_path / "d.jsonl", docs), val_fraction=0.2), seed=0, vocab_size=256)
    val_ids = {i for i in range(200) if held_out(i, 0.2)}
    assert 20 < len(val_ids) < 60

    def seen(batch) -> set[int]:
        text = bytes(b for row in batch[0].tolist() for b in row).decode("latin-1")
        return {int(text[j + 1:j + 4]) for j in range(len(text) - 4) if text[j] == "<" and text[j + 1:j + 4].isdigit()}

    train = set().union(*(seen(src.batch(k)) for k in range(60)))
    val = set().union(*(seen(src.batch(i, split="val")) for i in range(3)))
    assert train and val and not train & val_ids and val <= val_ids
    assert torch.equal(src.batch(1, split="val")[0], src.batch(1, split="val")[0])  # eval batch i: a function of i


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
def test_a_streamed_mixture_holds_its_weights_and_reports_its_tokens(tmp_path):
    web, code = jsonl(tmp_path / "web.jsonl", DOCS), jsonl(tmp_path / "code.jsonl", [d.upper() for d in DOCS])
    cfg = DataConfig(name="datasets", sources=[{"path": str(web), "weight": 3}, {"path": str(code), "weight": 1}],
                     batch_size=8, seq_len=16, tokenizer="byte", streaming=True, val_fraction=0.0)
    src = build_data(cfg, seed=0, vocab_size=256)
    web_tokens = total = 0
    for k in range(40):
        src.batch(k)
        web_tokens += src.last_stats[f"{names.DATA_TOKENS}/web"]
        total += src.last_stats[names.DATA_TOKENS]
    assert web_tokens / total == 0.75 and src.last_stats[names.DATA_PADDING] == 0.0


def test_without_packing_padding_is_counted_and_not_trained_on(tmp_path):
    src = build_data(config(jsonl(tmp_path / "d.jsonl", DOCS), packing=False, seq_len=40), seed=0, vocab_size=256)
    x, y = src.batch(0)
    lengths = [len(d.encode()) + 1 for d in DOCS[:4]]  # + EOS
    assert [int((row != -1).sum()) for row in y] == [min(n, 41) - 1 for n in lengths]
    assert src.last_stats[names.DATA_TOKENS] == sum(min(n, 40) for n in lengths)
    assert src.last_stats[names.DATA_PADDING] > 0


def test_streaming_null_streams_a_hub_name_or_big_files_only(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", DOCS)
    assert not streams(config(path, streaming=None))
    assert streams(config(path, streaming=True))
    # data=sft renders and caches its chats once: a hub name does not make it stream (the streams rule
    # read alone here: a DataConfig of data=sft needs a chat-template folder; test_sft.py builds one)
    sft_hub = dataclasses.replace(config(path, streaming=None), path="owner/name")
    sft_hub.name = "sft"
    assert not streams(sft_hub)
    sft_hub.name = "datasets"
    assert streams(sft_hub), "the same source under data=datasets: a hub name streams"
