"""Real tokenizers (a Hugging Face tokenizer.json built here with the `tokenizers` library) and
pipetrain-prepare: documents -> llm.c shards with EOS between documents, read back exactly,
then trained on by `pipetrain data=tokens data.path=DIR`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_torch_free, run_cli

from pipetrain.config.data import DataConfig, hf_vocab_size
from pipetrain.config.shards import read_shard
from pipetrain.config.token_origin import RECORD
from pipetrain.prepare import VAL_MIN_TOKENS, prepare
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


def quiet(_: str) -> None:
    pass


def splits(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The train and val token streams of a prepared folder, each in shard order."""
    return tuple(read_stream([read_shard(f, knob="x") for f in sorted(out.glob(f"{s}_*.bin"))])
                 for s in ("train", "val"))


def split_of(docs: list[np.ndarray], train: np.ndarray, val: np.ndarray) -> list[str]:
    """Which split each document went to, read back from the two streams, which must hold the
    documents whole and in order, except for a tail of the stream moved to the end of val."""
    where, t, v = [], 0, 0
    for d in docs:
        if np.array_equal(val[v:v + len(d)], d):
            where.append("val")
            v += len(d)
        else:
            assert np.array_equal(train[t:t + len(d)], d[:len(train) - t]), f"document {len(where)} is in neither"
            where.append("train")
            t += len(d)
    assert t >= len(train) and len(train) + len(val) == sum(len(d) for d in docs)
    return where


@pytest.mark.pure
def test_prepare_jsonl_with_hf_puts_eos_before_every_document(tmp_path):
    """A corpus too small for its 0.5% to reach --val-min-tokens: validation is the end of the
    stream, cut at a document's start; every shard reads back exactly."""
    folder = tiny_tokenizer(tmp_path / "tok")
    docs = [SENTENCES[i % 5] + f" {i}" for i in range(60)]
    out = tmp_path / "shards"
    written = prepare([str(write_jsonl(tmp_path / "d.jsonl", docs, field="body"))], str(out), tokenizer="hf",
                      tokenizer_dir=str(folder), text_field="body", shard_tokens=200, val_min_tokens=50, note=quiet)
    tok = load_tokenizer("hf", str(folder))
    expect = np.concatenate([[tok.eos_id, *tok.encode(d)] for d in docs])
    names = sorted(p.name for p in out.glob("*.bin"))
    assert names[0] == "train_000000.bin" and names[-1] == "val_000000.bin" and len(names) > 3
    record = json.loads((out / RECORD).read_text())  # which tokenizer made them (a run with another refuses them)
    assert record["tokenizer"] == "hf" and record["file"] == str((folder / "tokenizer.json").resolve())
    assert (record["vocab_size"], record["eos_id"]) == (tok.vocab_size, tok.eos_id) and len(record["sha256"]) == 64
    shards = [read_shard(out / n, knob="x") for n in names]
    assert all(s.kind == "llmc" and s.dtype == "<u2" for s in shards)
    assert all(s.count == 200 for s in shards[:-2]) and 0 < shards[-2].count <= 200
    train, val = splits(out)
    assert np.array_equal(np.concatenate([train, val]), expect)  # validation is the stream's end
    assert val[0] == tok.eos_id and 50 <= len(val) <= 100  # from a document's start, at most 2x the floor
    assert [len(v) for v in written.values()] == [len(names) - 1, 1]
    assert [p for p, _ in written["val"]] == [out / "val_000000.bin"]


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
            tokenizer_dir=str(tmp_path / "tok"), val_fraction=0.25, val_min_tokens=1, note=quiet)
    train, val = (read_shard(out / f"{s}_000000.bin", knob="x") for s in ("train", "val"))
    assert train.dtype == val.dtype == "<u4"  # 70,000 ids do not fit 16 bits
    every = [np.array([1, i + 2, 69_999 - i, 40_000 + i]) for i in range(40)]
    assert np.array_equal(read_stream([val]), np.concatenate(every[3::4]))  # equal documents: every 4th
    assert np.array_equal(read_stream([train]), np.concatenate([d for i, d in enumerate(every) if i % 4 != 3]))


@pytest.mark.pure
def test_validation_is_a_fraction_of_the_tokens_in_whole_documents(tmp_path):
    """Documents of unequal lengths: validation holds whole documents, spread over the corpus,
    within one document of the fraction; a few long documents get their share from the end."""
    docs = [f"doc {i}: " + "word " * (3 + (i * 7) % 40) for i in range(400)]
    out = tmp_path / "out"
    prepare([str(write_jsonl(tmp_path / "d.jsonl", docs))], str(out), val_fraction=0.05, val_min_tokens=100,
            note=quiet)
    ids = [np.array([0, *d.encode()]) for d in docs]  # byte tokens, NUL (0) before each document
    train, val = splits(out)
    where = split_of(ids, train, val)
    total, longest = sum(len(d) for d in ids), max(len(d) for d in ids)
    assert 0.05 * total - longest < len(val) <= 0.05 * total  # whole documents, no top-up needed
    picked = [i for i, w in enumerate(where) if w == "val"]
    assert picked[0] < 40 and picked[-1] > 360, picked  # spread over the corpus, not its end

    long_docs = [chr(65 + i) * 3000 for i in range(4)]  # 3,001 tokens each: none fits 10% of 12,004
    prepare([str(write_jsonl(tmp_path / "l.jsonl", long_docs))], str(tmp_path / "long"), val_fraction=0.1,
            val_min_tokens=100, note=quiet)
    train, val = splits(tmp_path / "long")
    assert len(val) == 1201 and bytes(val.astype(np.uint8)) == b"D" * 1201  # ceil(10%), cut inside the last
    assert len(train) == 4 * 3001 - 1201


@pytest.mark.pure
def test_prepare_errors_are_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("short text")
    cases = [
        (dict(inputs=[str(tmp_path / "a.txt")]), ["11 tokens", "--val-min-tokens", "at most 5"]),
        (dict(inputs=[str(write_jsonl(tmp_path / "b.jsonl", ["x"], field="content"))]), ["'text'", "--text-field"]),
        (dict(inputs=[str(tmp_path / "missing.txt")]), ["does not exist"]),
        (dict(inputs=[str(tmp_path / "a.txt")], val_fraction=0.9), ["--val-fraction", "(0, 0.5]"]),
        (dict(inputs=[str(tmp_path / "a.txt")], val_min_tokens=0), ["--val-min-tokens", "data.seq_len"]),
    ]
    for i, (kw, words) in enumerate(cases):
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            prepare(out=str(tmp_path / f"o{i}"), note=quiet, **kw)
        assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl"]  # no out, no partial folder
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    for module, kw in (("pyarrow", dict(inputs=[str(tmp_path / "c.parquet")])),
                       ("tiktoken", dict(inputs=[str(tmp_path / "a.txt")], tokenizer="gpt2"))):
        if importlib.util.find_spec(module) is None:  # the pip line, before any file is read
            with pytest.raises(ValueError, match=f"needs the {module} package: pip install {module}"):
                prepare(out=str(tmp_path / "o9"), note=quiet, **kw)


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
    err = fails(str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o1" / "deep"))
    assert err == f"pipetrain-prepare: error: the input is empty: {tmp_path / 'empty.txt'} holds no text " \
                  f"(1 document(s), none with more than whitespace): give files with text"
    assert not (tmp_path / "o1").exists()  # a refused run leaves nothing behind, not even the parents it made
    (tmp_path / "blank.txt").write_text(" \n\t\n" * 80)  # 320 bytes, each a token of the byte tokenizer (#44)
    err = fails(str(tmp_path / "blank.txt"), "--out", str(tmp_path / "o3"))
    assert err.startswith(f"pipetrain-prepare: error: the input is empty: {tmp_path / 'blank.txt'} holds no text"), err
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
def test_a_small_corpus_works_and_a_too_small_one_says_what_to_do(tmp_path, capsys):
    """The docs' command (docs/data.md) on a corpus of a few thousand tokens: no flag needed; one of 11 tokens
    gets one line naming --val-min-tokens, and the value it names works."""
    from pipetrain.prepare import main

    write_jsonl(tmp_path / "small.jsonl", [f"line {i} of a small corpus" for i in range(150)])
    main([str(tmp_path / "small.jsonl"), "--out", str(tmp_path / "data" / "corpus")])
    printed = capsys.readouterr().out
    train, val = splits(tmp_path / "data" / "corpus")
    assert len(val) >= VAL_MIN_TOKENS and len(train) >= len(val) and "data.seq_len <= 1,02" in printed, printed
    (tmp_path / "tiny.txt").write_text("short text")
    with pytest.raises(SystemExit) as code:
        main([str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "tiny")])
    err = capsys.readouterr().err.strip()
    assert code.value.code == 2 and err == (
        "pipetrain-prepare: error: the input holds 11 tokens, too few to hold out --val-min-tokens=1,025 for "
        "validation and train on at least as many: lower --val-min-tokens (at most 5; validation needs one "
        "window of data.seq_len + 1 tokens) or give more text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "small.jsonl", "tiny.txt"]
    main([str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "tiny"), "--val-min-tokens", "5"])
    train, val = splits(tmp_path / "tiny")
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == b"\0short text" and len(val) == 5


@pytest.mark.pure
def test_out_folder_keeps_what_the_tool_did_not_write(tmp_path):
    corpus = write_jsonl(tmp_path / "d.jsonl", [f"document {i} " * 5 for i in range(100)])
    kw = dict(val_min_tokens=100, note=quiet)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not empty \(1 entries, e.g. notes.txt\): pass --overwrite"):
        prepare([str(corpus)], str(out), **kw)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    prepare([str(corpus)], str(out), overwrite=True, **kw)  # asked for: the folder is replaced whole
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "train_000000.bin", "val_000000.bin"]
    before = splits(out)
    (tmp_path / "tiny.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too few"):  # a failed --overwrite run keeps the old folder whole
        prepare([str(tmp_path / "tiny.txt")], str(out), overwrite=True, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(before, splits(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "out", "tiny.txt"]
    with pytest.raises(ValueError, match="holds an input"):  # never, even with --overwrite
        prepare([str(corpus)], str(tmp_path), overwrite=True, **kw)
    assert corpus.exists()
    (tmp_path / "empty").mkdir()
    prepare([str(corpus)], str(tmp_path / "empty"), **kw)  # an empty folder is taken as it is
    assert len(list((tmp_path / "empty").iterdir())) == 3  # two shards and the record
    stray = tmp_path / ".other.partial"  # a dead run's folder with a file the tool does not write
    stray.mkdir()
    (stray / "keep.me").write_text("x")
    with pytest.raises(ValueError, match="holds files pipetrain-prepare does not write \\(keep.me\\)"):
        prepare([str(corpus)], str(tmp_path / "other"), **kw)
    assert (stray / "keep.me").exists() and not (tmp_path / "other").exists()


@pytest.mark.e2e
def test_a_killed_run_leaves_no_shard_and_the_retry_succeeds(tmp_path):
    """pipetrain-prepare reads a pipe, writes its first shards and waits for more; it is killed
    (SIGKILL: no cleanup runs). --out does not exist, a second run meanwhile is refused (the first
    one's lock), and once the killer's run is dead the retry reclaims its partial folder."""
    import os
    import signal
    import subprocess
    import time

    docs = [f"document number {i} of a corpus that arrives slowly " * 2 for i in range(300)]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    fifo, out = tmp_path / "corpus.jsonl", tmp_path / "data" / "corpus"
    os.mkfifo(fifo)

    def shards() -> list[Path]:
        return sorted(tmp_path.rglob("*.bin"))

    proc = subprocess.Popen([sys.executable, "-m", "pipetrain.prepare", str(fifo), "--out", str(out),
                             "--shard-tokens", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while True:  # open the pipe's write end once the run has opened its read end
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
        os.set_blocking(fd, True)
        os.write(fd, lines)  # 300 documents, ~33k tokens: one encode batch (256) is written, then it waits
        while not shards():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        (tmp_path / "other.txt").write_text("other text " * 500)
        with pytest.raises(ValueError, match="another pipetrain-prepare is writing"):
            prepare([str(tmp_path / "other.txt")], str(out), note=quiet)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.close(fd)
    finally:
        proc.kill()
        proc.communicate()
    assert not out.exists() and shards() and all(p.parent.name == ".corpus.partial" for p in shards())
    fifo.unlink()
    fifo.write_bytes(lines)  # the retry reads the same corpus from a file
    printed: list[str] = []
    written = prepare([str(fifo)], str(out), shard_tokens=1000, note=printed.append)
    assert any("the partial output of an interrupted run" in line for line in printed), printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus"]  # the partial folder is gone
    train, val = splits(out)
    assert split_of([np.array([0, *d.encode()]) for d in docs], train, val)
    assert [p for p, _ in written["train"]] == sorted(out.glob("train_*.bin"))


@pytest.mark.pure
def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"document number {i} " * 3 for i in range(30)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    prepare([str(tmp_path / "d.parquet")], str(tmp_path / "out"), val_fraction=0.1, val_min_tokens=1, note=quiet)
    train, val = splits(tmp_path / "out")
    where = split_of([np.array([0, *d.encode()]) for d in docs], train, val)
    assert where.count("val") == 3 and len(val) <= 0.1 * (len(train) + len(val))


@pytest.mark.pure
def test_prepare_imports_no_torch():
    assert_torch_free("import pipetrain.prepare")


def readme_corpus(path: Path, tokens: int, tok) -> Path:
    """A jsonl of documents made of SENTENCES, about `tokens` tokens long under `tok`."""
    docs, count, i = [], 0, 0
    while count < tokens:
        doc = " ".join(SENTENCES[(i + j) % 5] for j in range(1 + i % 7))
        docs.append(doc)
        count += 1 + len(tok.encode(doc))
        i += 1
    return write_jsonl(path, docs)


@pytest.mark.e2e
@pytest.mark.slow
def test_readme_prepare_example_on_a_small_corpus_trains(tmp_path):
    """The docs' two commands as written (docs/data.md) (--tokenizer hf --tokenizer-dir ... --shard-tokens 10^7)
    on a 50k-token jsonl: train and val shards, then `pipetrain data=tokens data.path=...` trains
    on them and evaluates on the val shard (2 ranks, llama-tiny: the docs' model is 1B)."""
    import subprocess

    folder = tiny_tokenizer(tmp_path / "tok")
    tok = load_tokenizer("hf", str(folder))
    readme_corpus(tmp_path / "corpus.jsonl", 50_000, tok)
    res = subprocess.run([sys.executable, "-m", "pipetrain.prepare", "corpus.jsonl", "--out", "data/corpus",
                          "--tokenizer", "hf", "--tokenizer-dir", str(folder), "--shard-tokens", "10000000"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "data" / "corpus"
    assert f"data.path={out}" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "train_000000.bin", "val_000000.bin"]
    train, val = splits(out)
    assert 50_000 <= len(train) + len(val) < 50_100 and VAL_MIN_TOKENS <= len(val) <= 2 * VAL_MIN_TOKENS
    res = run_cli(["model=llama-tiny", "data=tokens", "data.path=data/corpus", "trainer.max_steps=4",
                   "trainer.eval_every=2", "trainer.ckpt_at_end=false", "sim.timeline=false", "logger=[console]",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["train/loss"] < summary["train/first_loss"], summary
    assert summary["train/val_loss"] > 0, summary  # evaluated on val_000000.bin
