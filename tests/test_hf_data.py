"""data=datasets on real files that `datasets` itself wrote: every input kind gives the same documents,
the packed stream separates them by EOS, an epoch's rows are disjoint and cover the stream, dp halves
never share a row, step k's batch is the same after a rebuild, and bad sources are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.config.data import DataConfig
from pipetrain.parallel.dp import local_rows
from pipetrain.train.data import build_data
from pipetrain.train.hf_build import build_hf_data
from pipetrain.train.hf_data import PackedRows
from pipetrain.train.tokenizer import BYTE_EOS

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.pure

DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) + "end." for i in range(120)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """The tokenized streams go to this test's own cache, not ~/.cache."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def config(path, **knobs) -> DataConfig:
    return DataConfig(name="datasets", path=str(path), **{"batch_size": 4, "seq_len": 16, "tokenizer": "byte",
                                                          **knobs})


def byte_stream(docs, *, bos=None) -> np.ndarray:
    out = []
    for d in docs:
        out += [*([bos] if bos is not None else []), *d.encode(), BYTE_EOS]
    return np.asarray(out)


def write_kinds(root: Path, docs=DOCS) -> dict[str, Path]:
    """The same documents in every form data.path takes, written by `datasets`."""
    ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    ds.save_to_disk(root / "saved")
    (root / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(root / "hub" / "data" / "train-00000-of-00001.parquet")
    ds.to_parquet(root / "one.parquet")
    ds.to_json(root / "one.jsonl")
    ds.to_csv(root / "one.csv", index=False)
    (root / "shards").mkdir()
    half = len(docs) // 2
    ds.select(range(half)).to_json(root / "shards" / "a.jsonl")
    ds.select(range(half, len(docs))).to_json(root / "shards" / "b.jsonl")
    arrow = next((root / "saved").glob("*.arrow"))
    return {"save_to_disk": root / "saved", "hub-layout": root / "hub", "parquet": root / "one.parquet",
            "jsonl": root / "one.jsonl", "csv": root / "one.csv", "glob": root / "shards" / "*.jsonl",
            "arrow": arrow, "dataset_dict": _saved_dict(root / "dict", ds)}


def _saved_dict(path: Path, ds) -> Path:
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(10))}).save_to_disk(path)
    return path


# ---- the stream -------------------------------------------------------------------------------------


def test_every_input_kind_loads_the_same_documents_eos_between_them(tmp_path):
    kinds = write_kinds(tmp_path / "src")
    want = byte_stream(DOCS)
    for kind, path in kinds.items():
        source = build_hf_data(config(path, val_fraction=0.0), seed=0, vocab_size=256)
        assert np.array_equal(np.asarray(source.parts["train"]), want), kind


def test_add_bos_puts_the_tokenizers_bos_before_every_document(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for d in DOCS for w in d.replace(":", " ").split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    path = write_kinds(tmp_path / "src")["jsonl"]
    source = build_hf_data(config(path, val_fraction=0.0, tokenizer="hf", tokenizer_dir=str(tmp_path / "tok"),
                                  add_bos=True), seed=0, vocab_size=len(vocab))
    want = [t for d in DOCS for t in (1, *tok.encode(d, add_special_tokens=False).ids, 2)]
    assert np.array_equal(np.asarray(source.parts["train"]), want)
    # a document starts after every EOS: the boundaries are recoverable from the ids alone
    stream = np.asarray(source.parts["train"])
    assert (stream[np.flatnonzero(stream == 2)[:-1] + 1] == 1).all()


def test_validation_is_the_last_whole_documents(tmp_path):
    path = write_kinds(tmp_path / "src")["save_to_disk"]
    source = build_hf_data(config(path, val_fraction=0.2), seed=0, vocab_size=256)
    train, val = np.asarray(source.parts["train"]), np.asarray(source.parts["val"])
    assert np.array_equal(np.concatenate([train, val]), byte_stream(DOCS))
    assert train[-1] == BYTE_EOS and 0.15 < len(val) / (len(train) + len(val)) < 0.25


def test_val_split_of_a_saved_dataset_dict(tmp_path):
    path = write_kinds(tmp_path / "src")["dataset_dict"]
    source = build_hf_data(config(path, val_split="validation"), seed=0, vocab_size=256)
    assert np.array_equal(np.asarray(source.parts["val"]), byte_stream(DOCS[:10]))


# ---- the rows -------------------------------------------------------------------------------------


def positions(n=1000, *, batch_size=8, seq_len=9, seed=0) -> PackedRows:
    """A stream whose token i is i: a row's first token tells which row it is."""
    return PackedRows({"train": np.arange(n)}, batch_size=batch_size, seq_len=seq_len, seed=seed, packing=True,
                      eos_id=n + 1, what="positions")


def test_rows_of_an_epoch_are_disjoint_and_cover_the_stream():
    src = positions()
    rows, steps = src.num_rows("train"), src.steps_per_epoch
    assert (rows, steps) == (100, 12)
    for epoch in (0, 1):
        seen = np.concatenate([src.row_ids(epoch * steps + j) for j in range(steps)])
        assert len(set(seen.tolist())) == steps * 8 and seen.max() < rows  # 96 of 100: 4 left over this epoch
    x, y = src.batch(0)
    assert torch.equal(x[:, 0] % 10, torch.zeros(8, dtype=torch.long))  # rows start at multiples of T + 1
    assert torch.equal(y, x + 1)  # targets: the inputs shifted by one
    every = np.concatenate([src.batch(j)[0][:, :1].numpy().ravel() // 10 for j in range(steps)])
    assert sorted(every.tolist()) == sorted(np.concatenate([src.row_ids(j) for j in range(steps)]).tolist())


def test_one_epoch_of_all_rows_is_the_whole_stream_once():
    src = positions(batch_size=100)  # 100 rows of 10 tokens: one step is the whole epoch
    x, y = src.batch(0)
    windows = torch.cat([x, y[:, -1:]], dim=1)  # (B, T + 1): each row's tokens
    assert torch.equal(windows.flatten().sort().values, torch.arange(1000))


def test_an_epoch_boundary_starts_a_new_permutation():
    src = positions()
    first = np.concatenate([src.row_ids(j) for j in range(12)])
    second = np.concatenate([src.row_ids(12 + j) for j in range(12)])
    assert not np.array_equal(first, second)


def test_two_dp_halves_never_share_a_row_within_an_epoch():
    src = positions()
    halves: list[set[int]] = [set(), set()]
    for step in range(src.steps_per_epoch):
        batch = src.batch(step)
        for dp_index in (0, 1):
            x, _ = local_rows(batch, dp_index, 2)
            halves[dp_index] |= set(x[:, 0].tolist())
    assert not halves[0] & halves[1] and len(halves[0]) == len(halves[1]) == 48


def test_step_k_is_the_same_after_a_rebuild_and_a_retokenization(tmp_path, monkeypatch):
    path = write_kinds(tmp_path / "src")["hub-layout"]
    first = build_data(config(path), seed=3, vocab_size=256)
    again = build_data(config(path), seed=3, vocab_size=256)  # reads the cached stream
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "other-cache"))
    fresh = build_data(config(path), seed=3, vocab_size=256)  # tokenizes again
    epoch = first.steps_per_epoch
    for step in (0, 5, epoch - 1, epoch, epoch + 1):  # into the second epoch
        for split in ("train", "val"):
            want = first.batch(step, split=split)
            for other in (again, fresh):
                got = other.batch(step, split=split)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(list((tmp_path / "hf-cache" / "pipetrain-packed").glob("*/meta.json"))) == 1


def test_without_packing_a_row_is_one_document_and_its_padding_is_not_trained_on(tmp_path):
    path = write_kinds(tmp_path / "src")["jsonl"]
    src = build_hf_data(config(path, packing=False, seq_len=40, val_fraction=0.0), seed=0, vocab_size=256)
    assert src.num_rows("train") == len(DOCS)
    x, y = src.batch(0)
    for row, doc in zip(src.row_ids(0), x):
        ids = [*DOCS[row].encode(), BYTE_EOS][:41]
        assert doc[: len(ids) - 1].tolist() == ids[:-1]
    assert (y == -1).any() and (y[y != -1] < 256).all()


# ---- one-line errors -------------------------------------------------------------------------------


def one_line(err: BaseException, *words: str) -> None:
    text = str(err)
    assert "\n" not in text and all(w in text for w in words), text


def test_a_missing_field_names_the_file_and_the_fields(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:5]))
    with pytest.raises(ValueError) as info:
        config(path)
    one_line(info.value, str(path), "'text'", "fields: body", "data.text_field")


def test_an_empty_source_is_refused_naming_it(tmp_path):
    datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "empty")
    with pytest.raises(ValueError) as info:
        config(tmp_path / "empty")
    one_line(info.value, str(tmp_path / "empty"), "empty")
    datasets.Dataset.from_dict({"text": ["", ""]}).save_to_disk(tmp_path / "blank")
    with pytest.raises(ValueError) as info:
        build_hf_data(config(tmp_path / "blank"), seed=0, vocab_size=256)
    one_line(info.value, str(tmp_path / "blank"), "no text")


def test_add_bos_without_a_bos_token_is_refused(tmp_path):
    path = write_kinds(tmp_path / "src")["jsonl"]
    with pytest.raises(ValueError) as info:
        config(path, add_bos=True)
    one_line(info.value, "data.add_bos", "byte", "data.add_bos=false")


@pytest.mark.parametrize("knobs, words", [
    ({"path": "no/such/file.jsonl"}, ["no/such/file.jsonl", "does not exist"]),
    ({"path": "*.nothing"}, ["matches no file"]),
    ({"split": "validation"}, ["split 'validation'"]),
    ({"val_split": "validation"}, ["one split", "data.val_split"]),
])
def test_bad_sources_are_one_line(tmp_path, monkeypatch, knobs, words):
    monkeypatch.chdir(tmp_path)
    path = write_kinds(tmp_path / "src")["hub-layout" if "split" in knobs else "jsonl"]
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        config(**{"path": path, **knobs})
    one_line(info.value, *words)


def test_other_sources_refuse_the_datasets_knobs():
    with pytest.raises(ValueError) as info:
        DataConfig(name="builtin", text_field="body")
    one_line(info.value, "data.text_field", "data=datasets")

