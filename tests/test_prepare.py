"""Real tokenizers (a Hugging Face tokenizer.json built here with the `tokenizers` library) and
pipetrain-prepare: documents -> llm.c shards with EOS between documents, read back exactly,
then trained on by `pipetrain data=tokens data.path=DIR`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_torch_free, run_cli

from pipetrain.config.data import DataConfig, hf_vocab_size
from pipetrain.config.shards import read_shard
from pipetrain.prepare import prepare
from pipetrain.train.data import build_data, load_tokens
from pipetrain.train.tokenizer import load_tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a pipeline cuts the model into stages",
    "every rank runs its own stages and sends activations on",
    "the loss falls as the model learns the text",
    "tokens are ids and shards hold many tokens",
]


def tiny_tokenizer(folder: Path, *, eos_in_config: str | None = None) -> Path:
    """A BPE tokenizer.json trained on SENTENCES (vocab ~120), with </s> and <|endoftext|> tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=[
        "<unk>", "</s>", "<|endoftext|>"], show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos_in_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos_in_config}}))
    return folder


def read_stream(shards) -> np.ndarray:
    return np.concatenate([np.fromfile(s.path, dtype=s.dtype, offset=s.offset) for s in shards]).astype(np.int64)


def write_jsonl(path: Path, docs, field="text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# ---- tokenizers -------------------------------------------------------------------------------


@pytest.mark.pure
def test_hf_tokenizer_json_encodes_as_the_tokenizers_library(tmp_path):
    from tokenizers import Tokenizer

    folder = tiny_tokenizer(tmp_path / "tok")
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = load_tokenizer("hf", str(folder))
    text = " ".join(SENTENCES)
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.vocab_size == ref.get_vocab_size() == hf_vocab_size(folder / "tokenizer.json")
    assert tok.eos_id == ref.token_to_id("<|endoftext|>")  # the first known EOS name it holds
    configured = load_tokenizer("hf", str(tiny_tokenizer(tmp_path / "tok2", eos_in_config="</s>")))
    assert configured.eos_id == ref.token_to_id("</s>")  # tokenizer_config.json's eos_token wins
    # data=text with data.tokenizer=hf trains on the same ids.
    (tmp_path / "a.txt").write_text((text + "\n") * 40)
    cfg = DataConfig(name="text", path=str(tmp_path / "a.txt"), tokenizer="hf", tokenizer_dir=str(folder),
                     batch_size=2, seq_len=16)
    assert load_tokens(cfg).tolist() == ref.encode((text + "\n") * 40, add_special_tokens=False).ids
    x, y = build_data(cfg, seed=0, vocab_size=128).batch(0)
    assert x.shape == (2, 16) and int(x.max()) < tok.vocab_size


@pytest.mark.pure
def test_hf_vocabulary_must_fit_the_model(tmp_path, compose):
    folder = tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text(" ".join(SENTENCES) * 50)
    cfg = DataConfig(name="text", path=str(tmp_path / "a.txt"), tokenizer="hf", tokenizer_dir=str(folder))
    need = hf_vocab_size(folder / "tokenizer.json")
    with pytest.raises(ValueError) as info:
        build_data(cfg, seed=0, vocab_size=need - 1)
    msg = str(info.value)
    assert f"model.vocab_size={need - 1}" in msg and f">= {need}" in msg and "\n" not in msg
    args = ["mode=train", "model=gpt2-tiny", f"model.vocab_size={need - 1}", "data=text", f"data.path={tmp_path}/a.txt",
            "data.tokenizer=hf", f"data.tokenizer_dir={folder}"]
    with pytest.raises(Exception) as info:  # before any process starts
        compose(args)
    assert "data.tokenizer=hf" in str(info.value)
    compose(["mode=simulate", *args[1:]])  # a simulation reads no tokens


@pytest.mark.pure
@pytest.mark.parametrize("knobs, words", [
    ({"tokenizer": "hf"}, ["data.tokenizer=hf", "data.tokenizer_dir="]),
    ({"tokenizer": "hf", "tokenizer_dir": "/nonexistent"}, ["data.tokenizer_dir=/nonexistent", "tokenizer.json"]),
    ({"tokenizer": "byte", "tokenizer_dir": "/x"}, ["data.tokenizer_dir", "data.tokenizer=hf"]),
])
def test_tokenizer_errors_name_the_knob(knobs, words):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        DataConfig(**knobs)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


# ---- prepare ----------------------------------------------------------------------------------


@pytest.mark.pure
def test_prepare_jsonl_with_hf_puts_eos_before_every_document(tmp_path):
    folder = tiny_tokenizer(tmp_path / "tok")
    docs = [SENTENCES[i % 5] + f" {i}" for i in range(60)]
    out = tmp_path / "shards"
    written = prepare([str(write_jsonl(tmp_path / "d.jsonl", docs, field="body"))], str(out), tokenizer="hf",
                      tokenizer_dir=str(folder), text_field="body", shard_tokens=200, note=lambda _: None)
    tok = load_tokenizer("hf", str(folder))
    expect = np.concatenate([[tok.eos_id, *tok.encode(d)] for d in docs])
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "train_000001.bin" and names[-1] == "val_000000.bin" and len(names) > 3
    shards = [read_shard(out / n, knob="x") for n in ["val_000000.bin", *names[:-1]]]
    assert all(s.kind == "llmc" and s.dtype == "<u2" for s in shards)
    assert all(s.count == 200 for s in shards[:-1]) and 0 < shards[-1].count <= 200
    assert np.array_equal(read_stream(shards), expect)  # the first shard (val) then train, in order
    assert [len(v) for v in written.values()] == [len(names) - 1, 1]


@pytest.mark.pure
def test_prepare_val_fraction_and_uint32_for_a_large_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    docs = [f"w{i + 2} w{69_999 - i} w{40_000 + i}" for i in range(40)]
    out = tmp_path / "out"
    prepare([str(write_jsonl(tmp_path / "d.jsonl", docs))], str(out), tokenizer="hf",
            tokenizer_dir=str(tmp_path / "tok"), val_fraction=0.25, note=lambda _: None)
    train, val = (read_shard(out / f"{s}_000000.bin", knob="x") for s in ("train", "val"))
    assert train.dtype == val.dtype == "<u4"  # 70,000 ids do not fit 16 bits
    every = [np.array([1, i + 2, 69_999 - i, 40_000 + i]) for i in range(40)]
    assert np.array_equal(read_stream([val]), np.concatenate(every[3::4]))  # every 4th document
    assert np.array_equal(read_stream([train]), np.concatenate([d for i, d in enumerate(every) if i % 4 != 3]))


@pytest.mark.pure
def test_prepare_errors_are_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("short text")
    cases = [
        (dict(inputs=[str(tmp_path / "a.txt")]), ["all", "one shard", "--shard-tokens"]),
        (dict(inputs=[str(write_jsonl(tmp_path / "b.jsonl", ["x"], field="content"))]), ["'text'", "--text-field"]),
        (dict(inputs=[str(tmp_path / "missing.txt")]), ["does not exist"]),
        (dict(inputs=[str(tmp_path / "a.txt")], val_fraction=1.5), ["--val-fraction"]),
    ]
    for i, (kw, words) in enumerate(cases):
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            prepare(out=str(tmp_path / f"o{i}"), note=lambda _: None, **kw)
        assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(ValueError, match="already holds shards"):  # o0 kept what it wrote
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "o0"), note=lambda _: None)
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install pyarrow"):
            prepare([str(tmp_path / "c.parquet")], str(tmp_path / "o9"), note=lambda _: None)


@pytest.mark.pure
def test_prepare_empty_input_and_out_file_are_one_line(tmp_path, capsys):
    from pipetrain.prepare import main

    def fails(*argv: str) -> str:
        with pytest.raises(SystemExit) as code:
            main(list(argv))
        err = capsys.readouterr().err
        assert code.value.code == 2 and len(err.strip().splitlines()) == 1, err
        return err.strip()

    (tmp_path / "empty.txt").write_text("")
    err = fails(str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o1"))  # was: lower --shard-tokens (e.g. 1)
    assert err == f"pipetrain-prepare: error: the input is empty: {tmp_path / 'empty.txt'} holds no text " \
                  f"(1 document(s), none with a token): give files with text"
    assert not (tmp_path / "o1").exists()  # a refused run leaves nothing behind
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    (tmp_path / "none.jsonl").write_text("\n")
    err = fails(str(tmp_path / "blank.jsonl"), str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o2"))
    assert "the input is empty" in err and "hold no text (2 document(s)" in err and "--text-field" in err
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "taken").write_bytes(b"precious")
    for out, words in ((tmp_path / "taken", "is a file"), (tmp_path / "taken" / "sub", "which is a file")):
        err = fails(str(tmp_path / "a.txt"), "--out", str(out))  # was: a FileExistsError traceback
        assert err.startswith(f"pipetrain-prepare: error: --out {out} ") and words in err and "name a folder" in err
    assert (tmp_path / "taken").read_bytes() == b"precious"


@pytest.mark.pure
def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"document number {i} " * 3 for i in range(30)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    prepare([str(tmp_path / "d.parquet")], str(tmp_path / "out"), val_fraction=0.1, note=lambda _: None)
    stream = read_stream([read_shard(tmp_path / "out" / "train_000000.bin", knob="x")])
    assert bytes(stream[stream != 0].astype(np.uint8)).decode() == "".join(d for i, d in enumerate(docs) if i % 10 != 9)


@pytest.mark.pure
def test_prepare_imports_no_torch():
    assert_torch_free("import pipetrain.prepare")


@pytest.mark.e2e
@pytest.mark.slow
def test_prepared_shards_train_end_to_end(tmp_path):
    """pipetrain-prepare (its module, as the console script runs it) on text files, then
    `pipetrain data=tokens data.path=OUT` trains on them: 2 ranks, a few steps, llama-tiny."""
    import subprocess

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(" ".join(SENTENCES[(i + j) % 5] for j in range(60)))
    out = tmp_path / "shards"
    res = subprocess.run([sys.executable, "-m", "pipetrain.prepare", str(corpus), "--out", str(out),
                          "--shard-tokens", "6000"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and f"data.path={out}" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == ["train_000001.bin", "train_000002.bin", "val_000000.bin"]
    res = run_cli(["model=llama-tiny", "data=tokens", f"data.path={out}", "trainer.max_steps=4", "trainer.eval_every=2",
                   "trainer.ckpt_at_end=false", "sim.timeline=false", "logger=[console]",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["train/loss"] < summary["train/first_loss"], summary
