"""Data: deterministic batches of step k, disjoint splits, every source on real files, the
built-in corpus from the installed package, and one-line errors that name the knob."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.resources
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.compose import CONF_DIR
from pipetrain.models.factory import build_model
from pipetrain.train.data import (
    CORPUS_FILE, ModelExamples, SyntheticTokens, TokenWindows, build_data, builtin_corpus, split_microbatches,
)
from pipetrain.config.data import DATA_SOURCES, DataConfig

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
# sha256 of the decompressed built-in corpus: the same bytes on every machine and every load.
CORPUS_SHA256 = "332842992adc17f32093c27e32b031b3a8dc640a561a8c51774a661c6d2a9320"


def root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:  # OmegaConf wraps errors raised in __post_init__
        err = err.__cause__
    return err


def write_bin(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype=np.uint16).tofile(path)  # nanoGPT's .bin: raw uint16, no header
    return path


@pytest.fixture
def positions_bin(tmp_path) -> Path:
    """Token i == i: a window's values tell where it came from."""
    return write_bin(tmp_path / "pos.bin", np.arange(5000))


def tokens_source(path, *, seed=0, vocab_size=65536, **knobs) -> TokenWindows:
    cfg = DataConfig(name="tokens", path=str(path), **{"batch_size": 4, "seq_len": 16, **knobs})
    return build_data(cfg, seed=seed, vocab_size=vocab_size)


# ---- determinism ------------------------------------------------------------------------------


def test_batch_of_step_k_is_a_function_of_seed_and_k():
    def make(seed):
        return build_data(DataConfig(), seed=seed, vocab_size=512)

    a, b = make(7), make(7)
    for k in (0, 1, 5, 123_456):
        for split in ("train", "val"):
            assert all(torch.equal(u, v) for u, v in zip(a.batch(k, split=split), b.batch(k, split=split)))
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    assert not torch.equal(a.batch(3)[0], make(8).batch(3)[0])
    # Asking out of order (as a resumed run does) changes nothing.
    assert torch.equal(make(7).batch(5)[0], a.batch(5)[0])


def test_batches_agree_across_processes():
    code = ("import sys, hashlib; from pipetrain.train.data import build_data; "
            "from pipetrain.config.data import DataConfig; "
            "x, y = build_data(DataConfig(), seed=3, vocab_size=512).batch(11, split='val'); "
            "print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="12345")  # Python's own hash() would differ between these
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    x, y = build_data(DataConfig(), seed=3, vocab_size=512).batch(11, split="val")
    assert out.strip() == hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


# ---- token windows ----------------------------------------------------------------------------


def test_shapes_dtypes_and_targets_shifted_by_one(positions_bin):
    x, y = tokens_source(positions_bin, batch_size=6, seq_len=32).batch(0)
    assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # position-valued tokens: the target is the next position
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_train_and_val_windows_are_disjoint(tmp_path):
    path = write_bin(tmp_path / "pos.bin", np.arange(1000))  # token i == i
    src = tokens_source(path, val_fraction=0.2, batch_size=32)  # train: positions 0..799, val: 800..999
    train = torch.stack([torch.stack(src.batch(k)) for k in range(200)])
    val = torch.stack([torch.stack(src.batch(k, split="val")) for k in range(200)])
    # Windows reach right up to the cut from both sides and never across it.
    assert (int(train.min()), int(train.max())) == (0, 799)
    assert (int(val.min()), int(val.max())) == (800, 999)
    assert "train 800, val 200" in src.description


def test_no_val_split_is_a_clear_error(positions_bin):
    src = tokens_source(positions_bin, val_fraction=0.0)
    assert int(src.batch(0)[1].max()) < 5000
    with pytest.raises(ValueError, match="data.val_fraction"):
        src.batch(0, split="val")


def test_tokens_file_is_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50257, 20_000, dtype=np.uint16)
    src = tokens_source(write_bin(tmp_path / "train.bin", data), vocab_size=50257)
    assert isinstance(src.tokens, np.memmap) and src.tokens.dtype == np.uint16
    stream = data.astype(np.int64)
    for row_x, row_y in zip(*src.batch(3)):  # every row is a contiguous piece of the file
        (start,) = [s for s in range(len(stream) - 16) if np.array_equal(stream[s:s + 16], row_x.numpy())][:1]
        assert np.array_equal(stream[start + 1:start + 17], row_y.numpy())


@pytest.mark.parametrize("shards", [1, 2])
def test_a_token_file_that_shrinks_under_the_run_is_one_line(tmp_path, shards):
    """#44: truncating a memory-mapped token file under a running job ended in SIGBUS stack dumps
    naming no file; the next batch now says which file shrank (one shard, and a folder of two)."""
    if shards == 1:
        path = victim = write_bin(tmp_path / "train.bin", np.arange(5000))
    else:
        path = tmp_path / "shards"
        path.mkdir()
        write_bin(path / "a_train_000.bin", np.arange(3000))
        victim = write_bin(path / "a_train_001.bin", np.arange(3000))
    src = tokens_source(path, val_fraction=0.0)
    src.batch(1)
    with victim.open("r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError) as info:
        for step in range(2, 50):  # until a batch reads the shrunk file (at once with one file)
            src.batch(step)
    mapped = f"{2 * (5000 if shards == 1 else 3000):,}"  # uint16
    assert str(info.value).startswith(f"{victim} shrank under the running job (100 bytes, {mapped} were mapped)")
    assert "\n" not in str(info.value)


def test_text_file_byte_tokens(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog. é\n" for i in range(300))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    src = build_data(DataConfig(name="text", path=str(path), batch_size=4, seq_len=40), seed=1, vocab_size=256)
    raw = path.read_bytes()
    x, y = src.batch(0)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert bytes(row_x) in raw and bytes(row_x[1:] + row_y[-1:]) in raw
    assert len(src.tokens) == len(raw)  # one token per byte (é is two)


def test_synthetic_tokens():
    src = build_data(DataConfig(name="synthetic", batch_size=4, seq_len=8), seed=0, vocab_size=100)
    assert isinstance(src, SyntheticTokens)
    x, y = src.batch(2)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64 and int(x.max()) < 100
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(src.batch(2)[0], x) and not torch.equal(src.batch(2, split="val")[0], x)


@pytest.mark.parametrize("name, knobs", [("mlp", {}), ("sleep", {"layers": 2, "f_ms": 0.0, "b_ms": 0.0, "w_ms": 0.0})])
@pytest.mark.parametrize("data", ["builtin", "synthetic"])
def test_non_token_models_get_their_example_batch(name, knobs, data):
    model = build_model(name, **knobs)
    src = build_data(DataConfig(name=data, batch_size=6, seq_len=16), seed=0, vocab_size=0, model=model)
    assert isinstance(src, ModelExamples)
    x, y = src.batch(4)
    ex, ey = model.example_batch(microbatch=6, seq=16)
    assert (x.shape, y.shape, x.dtype) == (ex.shape, ey.shape, ex.dtype)
    assert torch.equal(x, src.batch(4)[0]) and not torch.equal(x, src.batch(5)[0])


def test_token_files_refuse_non_token_models(positions_bin):
    with pytest.raises(ValueError, match="data=tokens"):
        build_data(DataConfig(name="tokens", path=str(positions_bin)), seed=0, vocab_size=0, model=build_model("mlp"))


def test_gpt2_model_reads_the_corpus():
    model = build_model("gpt2-tiny")
    src = build_data(DataConfig(), seed=0, vocab_size=model.config["vocab_size"], model=model)
    assert isinstance(src, TokenWindows)
    x, y = src.batch(0)
    assert model.loss(model(x), y).item() > 0


# ---- vocabulary -------------------------------------------------------------------------------


def test_token_ids_must_be_below_vocab_size(tmp_path):
    path = write_bin(tmp_path / "big.bin", [1, 2, 3, 1000] * 500)
    with pytest.raises(ValueError) as info:
        tokens_source(path, vocab_size=512)
    msg = str(info.value)
    assert "model.vocab_size=512" in msg and "1001" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="model.vocab_size=100"):  # the corpus has bytes >= 100 ('z' is 122)
        build_data(DataConfig(), seed=0, vocab_size=100)


# ---- microbatches -----------------------------------------------------------------------------


def test_split_microbatches():
    x, y = torch.arange(24).view(8, 3), torch.arange(24).view(8, 3) + 100
    parts = split_microbatches((x, y), 4)
    assert len(parts) == 4 and all(px.shape == (2, 3) and py.shape == (2, 3) for px, py in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError) as info:
        split_microbatches((x, y), 3)
    msg = str(info.value)
    assert "data.batch_size=8" in msg and "pipeline.microbatches=3" in msg and "\n" not in msg


# ---- the built-in corpus ----------------------------------------------------------------------


def test_builtin_corpus_ships_in_the_installed_package():
    import pipetrain

    resource = importlib.resources.files("pipetrain.train").joinpath(CORPUS_FILE)
    assert resource.is_file()
    assert Path(str(resource)).resolve().is_relative_to(Path(pipetrain.__file__).resolve().parent)
    text = builtin_corpus()
    assert hashlib.sha256(text).hexdigest() == CORPUS_SHA256 == hashlib.sha256(builtin_corpus()).hexdigest()
    assert 500_000 <= len(text) <= 2_000_000 and text.isascii()
    words = text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.7  # English prose, not code or noise
    for name in ("LICENSE-PSF.txt", "README.md"):  # licence and provenance travel with it
        assert importlib.resources.files("pipetrain.train").joinpath("corpus", name).is_file()


def test_pyproject_packages_the_corpus():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["pipetrain.train"]
    for f in (REPO / "pipetrain" / "train" / "corpus").iterdir():
        assert any(fnmatch.fnmatch(f"corpus/{f.name}", p) for p in shipped), f.name


def test_builtin_corpus_is_learnable_text():
    # Bytes repeat with a much lower entropy than random data: the bigram model of the
    # train split predicts the val split far better than a uniform 256-way guess.
    tokens = np.frombuffer(builtin_corpus(), dtype=np.uint8).astype(np.int64)
    cut = int(len(tokens) * 0.9)
    counts = np.ones((256, 256))
    np.add.at(counts, (tokens[:cut - 1], tokens[1:cut]), 1)
    probs = counts / counts.sum(1, keepdims=True)
    val_nll = -np.log(probs[tokens[cut:-1], tokens[cut + 1:]]).mean()
    assert val_nll < 0.5 * np.log(256)


# ---- config -----------------------------------------------------------------------------------


def test_config_files_are_the_data_options():
    assert sorted(p.stem for p in (Path(CONF_DIR) / "data").glob("*.yaml")) == sorted(DATA_SOURCES)


@pytest.mark.parametrize("name", DATA_SOURCES)
def test_every_data_option_composes(compose, tmp_path, name):
    extra = []
    if name == "text":
        (tmp_path / "a.txt").write_text("hello world, " * 100)
        extra = [f"data.path={tmp_path / 'a.txt'}"]
    elif name == "tokens":
        extra = [f"data.path={write_bin(tmp_path / 'a.bin', [i % 500 for i in range(2000)])}"]  # ids < gpt2-tiny's 512
    elif name == "datasets":
        from datasets import Dataset

        Dataset.from_dict({"text": ["hello world, " * 20] * 10}).save_to_disk(tmp_path / "saved")
        extra = [f"data.path={tmp_path / 'saved'}"]
    elif name == "sft":  # chats, and a model folder whose tokenizer has a chat template
        from _chat import chat_model, chats, write_jsonl

        extra = [f"data.path={write_jsonl(tmp_path / 'chat.jsonl', chats(10))}", "model=llama-tiny",
                 f"model.pretrained={chat_model(tmp_path / 'tiny-chat')}"]
    cfg = compose([f"data={name}", *extra])
    assert isinstance(cfg.data, DataConfig) and cfg.data.name == name
    # chats are longer than a pre-training toy row: data=sft's rows hold a whole sample or several
    assert (cfg.data.batch_size, cfg.data.seq_len) == (16, 256 if name == "sft" else 64)


def test_missing_file_fails_in_the_config(compose, tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(Exception) as info:
        compose(["data=tokens", f"data.path={missing}"])
    err = root_cause(info.value)
    assert isinstance(err, FileNotFoundError)
    assert str(err).startswith(f"data.path={missing} does not exist") and "\n" not in str(err)


@pytest.mark.parametrize(
    "knobs, words",
    [
        ({"name": "text"}, ["data=text", "data.path="]),
        ({"name": "tokens"}, ["data=tokens", "data.path="]),
        ({"path": "x.txt"}, ["data.path", "data=text"]),
        ({"name": "nope"}, ["data=", "builtin"]),
        ({"val_fraction": 1.0}, ["data.val_fraction"]),
        ({"tokenizer": "sentencepiece"}, ["data.tokenizer", "byte"]),
        ({"tokenizer_dir": "/x"}, ["data.tokenizer_dir", "data.tokenizer=gpt2"]),
        ({"batch_size": 0}, ["data.batch_size"]),
    ],
)
def test_bad_data_config_names_the_knob(knobs, words):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        DataConfig(**knobs)
    msg = str(info.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, msg


def test_bad_files_name_the_knob(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 301)
    with pytest.raises(ValueError, match=r"data.path: .*odd number of bytes"):
        DataConfig(name="tokens", path=str(odd))
    short = write_bin(tmp_path / "short.bin", range(1000))  # val 100 tokens < seq_len + 1
    with pytest.raises(ValueError) as info:
        DataConfig(name="tokens", path=str(short), seq_len=128)
    assert all(k in str(info.value) for k in ("data.seq_len=128", "data.val_fraction", "1,000 tokens"))
    DataConfig(name="tokens", path=str(short), seq_len=64)  # 100 >= 65: fits


def test_gpt2_tokenizer_without_its_files_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache: nothing local
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        DataConfig(tokenizer="gpt2")
    msg = str(info.value)
    assert "data.tokenizer=gpt2" in msg and "\n" not in msg
    assert "pip install tiktoken" in msg or ("data.tokenizer_dir" in msg and "TIKTOKEN_CACHE_DIR" in msg)
    DataConfig(name="synthetic", tokenizer="gpt2")  # token ids need no tokenizer


def _tiny_gpt2_vocab(folder: Path) -> None:
    """encoder.json in GPT-2's format: the 256 bytes (in GPT-2's printable alphabet and
    order), a few merges, then <|endoftext|>."""
    from pipetrain.train.tokenizer import _gpt2_byte_alphabet

    char = {b: c for c, b in _gpt2_byte_alphabet().items()}
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    order += [b for b in range(256) if b not in order]
    vocab = {char[b]: i for i, b in enumerate(order)}
    for token in ("th", "the", "\u0120the", "in", "\u0120a"):  # \u0120 is GPT-2's stand-in for a space
        vocab[token] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "encoder.json").write_text(json.dumps(vocab), encoding="utf-8")


def test_gpt2_tokenizer_from_a_local_folder(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    from pipetrain.train.tokenizer import gpt2_encoding

    _tiny_gpt2_vocab(tmp_path)
    text = "in the theatre a thing, in the end. " * 200
    (tmp_path / "a.txt").write_text(text)
    cfg = DataConfig(name="text", path=str(tmp_path / "a.txt"), tokenizer="gpt2", tokenizer_dir=str(tmp_path),
                     batch_size=2, seq_len=32)
    src = build_data(cfg, seed=0, vocab_size=512)
    enc = gpt2_encoding(str(tmp_path))
    assert isinstance(enc, tiktoken.Encoding) and enc.decode(src.tokens.tolist()) == text
    assert len(src.tokens) < len(text.encode())  # merges applied: fewer tokens than bytes
    x, y = src.batch(1)
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


# ---- purity -----------------------------------------------------------------------------------


def test_data_config_imports_neither_torch_nor_numpy():
    code = ("import sys; import pipetrain.config.data as d; d.DataConfig(); "
            "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert res.returncode == 0, res.stderr
