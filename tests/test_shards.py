"""Token shards: every format read back exactly as written (nanoGPT's raw .bin, llm.c's headered
.bin in uint16 and uint32, .npy), folders and globs read as one stream without concatenating,
separate validation shards, the stream mode=eval reads, and one-line errors naming the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipetrain.config.data import DataConfig
from pipetrain.config.shards import LLMC_HEADER_INTS, is_val_name, read_shard
from pipetrain.train.data import ShardStream, build_data, eval_tokens, load_tokens

pytestmark = pytest.mark.pure


def write_llmc(path, tokens, *, magic=20240520, version=1, dtype=np.uint16, count=None):
    """llm.c's write_datafile layout: 256 int32 (magic, version, token count, zeros), then the tokens."""
    header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=dtype).tobytes())
    return path


def write_raw(path, tokens):
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def stream(path, **knobs) -> np.ndarray:
    cfg = DataConfig(name="tokens", path=str(path), **{"seq_len": 8, **knobs})
    return np.asarray(load_tokens(cfg)[np.arange(sum(s.count for s in cfg.token_shards()[0]))], dtype=np.int64)


@pytest.mark.parametrize("fmt", ["raw", "llmc16", "llmc32", "npy16", "npy32", "npy64be"])
def test_every_format_reads_back_what_was_written(tmp_path, fmt):
    rng = np.random.default_rng(0)
    big = fmt in ("llmc32", "npy32", "npy64be")  # 128k+ vocabularies (Llama 3) need 32 bits
    tokens = rng.integers(0, 128_256 if big else 50_257, 3000)
    if fmt == "raw":
        path = write_raw(tmp_path / "a.bin", tokens)
    elif fmt.startswith("llmc"):
        path = write_llmc(tmp_path / "a.bin", tokens, **({"magic": 20240801, "version": 7, "dtype": np.uint32}
                                                         if big else {}))
    else:
        dtype = {"npy16": np.uint16, "npy32": np.uint32, "npy64be": ">i8"}[fmt]
        path = tmp_path / "a.npy"
        np.save(path, np.asarray(tokens).astype(dtype))
    assert np.array_equal(stream(path), tokens)
    shard = read_shard(path, knob="data.path")
    assert shard.count == 3000 and shard.kind == {"raw": "nanogpt", "llmc16": "llmc", "llmc32": "llmc"}.get(fmt, "npy")
    if big:
        assert int(stream(path).max()) > 65535


def test_uint32_tokens_train_a_128k_vocabulary(tmp_path):
    tokens = np.arange(128_000, 128_256).repeat(8)  # every id above 65535
    path = write_llmc(tmp_path / "llama.bin", tokens, magic=20240801, version=7, dtype=np.uint32)
    src = build_data(DataConfig(name="tokens", path=str(path), batch_size=4, seq_len=16), seed=0, vocab_size=128_256)
    x, y = src.batch(0)
    assert int(x.min()) >= 128_000 and x.dtype == torch.int64
    with pytest.raises(ValueError, match="model.vocab_size=128000"):
        build_data(DataConfig(name="tokens", path=str(path), batch_size=4, seq_len=16), seed=0, vocab_size=128_000)


def test_folder_and_glob_read_shards_in_sorted_order_as_one_stream(tmp_path):
    parts = [np.arange(i * 100, i * 100 + 100) for i in range(4)]
    folder = tmp_path / "shards"
    folder.mkdir()
    write_llmc(folder / "c_002.bin", parts[2])  # formats mix freely
    write_raw(folder / "a_000.bin", parts[0])
    np.save(folder / "b_001.npy", parts[1].astype(np.uint32))
    write_llmc(folder / "d_003.bin", parts[3])
    (folder / "notes.txt").write_text("not a shard: ignored")
    whole = np.concatenate(parts)
    assert np.array_equal(stream(folder), whole)
    assert np.array_equal(stream(f"{folder}/[ab]_*"), whole[:200])
    tokens = load_tokens(DataConfig(name="tokens", path=str(folder), seq_len=8))
    assert isinstance(tokens, ShardStream) and len(tokens) == 400 and tokens.max() == 399
    assert np.array_equal(tokens[95:305], whole[95:305])  # slices across shard boundaries
    # Windows cross shard boundaries and stay contiguous pieces of the stream (token i == i).
    src = build_data(DataConfig(name="tokens", path=str(folder), batch_size=64, seq_len=30), seed=0, vocab_size=512)
    x, y = src.batch(0)
    assert torch.equal(x + 1, y) and torch.equal(x[:, 1:] - x[:, :-1], torch.ones(64, 29, dtype=torch.int64))


def test_batches_are_a_function_of_seed_step_and_split(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    for i in range(3):
        write_llmc(folder / f"train_{i:06d}.bin", np.arange(i * 500, i * 500 + 500))
    write_llmc(folder / "val_000000.bin", np.arange(2000, 2300))
    cfg = DataConfig(name="tokens", path=str(folder), batch_size=4, seq_len=16)
    a, b = build_data(cfg, seed=3, vocab_size=4096), build_data(cfg, seed=3, vocab_size=4096)
    for k, split in ((0, "train"), (7, "train"), (7, "val")):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(k, split=split), b.batch(k, split=split)))
    assert not torch.equal(a.batch(7)[0], a.batch(7, split="val")[0])


def test_a_folders_val_shards_are_the_validation_split(tmp_path):
    folder = tmp_path / "prepared"
    folder.mkdir()
    write_llmc(folder / "fineweb_train_000001.bin", np.arange(0, 1000))
    write_llmc(folder / "fineweb_val_000000.bin", np.arange(1000, 1300))
    train, val = DataConfig(name="tokens", path=str(folder), seq_len=8).token_shards()
    assert [s.path.name for s in train] == ["fineweb_train_000001.bin"]
    assert [s.path.name for s in val] == ["fineweb_val_000000.bin"]
    src = build_data(DataConfig(name="tokens", path=str(folder), batch_size=32, seq_len=16), seed=0, vocab_size=2048)
    train_ids = torch.cat([src.batch(k)[0] for k in range(50)])
    val_ids = torch.cat([src.batch(k, split="val")[0] for k in range(50)])
    assert int(train_ids.max()) < 1000 <= int(val_ids.min())  # all of the training shard, none held out
    assert int(train_ids.max()) > 950 and "val 300" in src.description
    assert [is_val_name(tmp_path / n) for n in ("val.bin", "x_val_000.bin", "val0.npy", "interval.bin")] == [
        True, True, True, False]


def test_val_path_is_the_validation_split_and_what_eval_reads(tmp_path):
    train = write_raw(tmp_path / "train.bin", np.arange(0, 2000))
    val = write_raw(tmp_path / "other.bin", np.arange(3000, 3100))
    cfg = DataConfig(name="tokens", path=str(train), val_path=str(val), batch_size=8, seq_len=16)
    src = build_data(cfg, seed=0, vocab_size=4096)
    assert int(torch.cat([src.batch(k)[1] for k in range(30)]).max()) > 1900  # the tail is not held out
    assert int(src.batch(0, split="val")[0].min()) >= 3000
    assert np.array_equal(np.asarray(eval_tokens(cfg, vocab_size=4096)), np.arange(3000, 3100))
    # Without data.val_path, mode=eval reads all of data.path.
    whole = eval_tokens(DataConfig(name="tokens", path=str(train), seq_len=16), vocab_size=4096)
    assert np.array_equal(np.asarray(whole), np.arange(2000))
    with pytest.raises(ValueError, match="model.vocab_size=3000"):
        eval_tokens(cfg, vocab_size=3000)


@pytest.mark.parametrize("case, words", [
    ("odd", ["data.path", "odd number of bytes (301)", "data=text"]),
    ("empty", ["data.path", "empty shard"]),
    ("suffix", ["unknown format '.pt'", ".npy"]),
    ("version", ["unknown version 3", "magic 20240801 version 7"]),
    ("truncated", ["header says 500 tokens", "regenerate"]),
    ("magic", ["x.bin has an llm.c header (100 tokens, then zeros) with magic 20240519 version 1",
               "llm.c's header for its size is magic 20240520 version 1 (uint16 tokens)", "regenerate"]),
    ("magic32", ["with magic 20240802 version 7", "is magic 20240801 version 7 (uint32 tokens)"]),
    ("2d", ["not 1-D", "reshape(-1)"]),
    ("float", ["not integers"]),
    ("glob", ["matches no file"]),
    ("nofolder", ["no .bin or .npy shards"]),
    ("onlyval", ["only validation shards"]),
    ("short_val", ["data.val_path=", "too few for one window", "data.seq_len"]),
    ("val_on_text", ["data.val_path is only read by data=tokens"]),
])
def test_bad_shards_are_one_line_errors(tmp_path, case, words):
    p, knobs = tmp_path / "x.bin", {}
    if case == "odd":
        p.write_bytes(b"\x01" * 301)
    elif case == "empty":
        write_llmc(p, [])
    elif case == "suffix":
        p = tmp_path / "x.pt"
        p.write_bytes(b"\x00" * 64)
    elif case == "version":
        write_llmc(p, range(100), magic=20240801, version=3)
    elif case == "truncated":
        write_llmc(p, range(100), count=500)
    elif case == "magic":  # was read as raw uint16: "set model.vocab_size >= 55432"
        write_llmc(p, range(100), magic=20240519)
    elif case == "magic32":
        write_llmc(p, range(100), magic=20240802, version=7, dtype=np.uint32)
    elif case in ("2d", "float"):
        p = tmp_path / "x.npy"
        np.save(p, np.zeros((10, 10), np.uint16) if case == "2d" else np.zeros(100, np.float32))
    elif case == "glob":
        p = tmp_path / "*.bin"
    elif case == "nofolder":
        p = tmp_path
    elif case == "onlyval":
        write_raw(tmp_path / "val.bin", range(100))
        p = tmp_path
    elif case == "short_val":
        write_raw(p, range(1000))
        knobs = {"val_path": str(write_raw(tmp_path / "v.bin", range(5)))}
    else:
        p = tmp_path / "a.txt"
        p.write_text("hello " * 100)
        knobs = {"name": "text", "val_path": str(p)}
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        DataConfig(**{"name": "tokens", "path": str(p), "seq_len": 8, **knobs})
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
