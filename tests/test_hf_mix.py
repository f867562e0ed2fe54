"""data.sources: a mixture of jsonl sources written by `datasets`. The weights hold in the token stream,
step k's batch is a pure function of (seed, k), each source reads every row once an epoch, two dp
ranks never share a row, and bad mixtures are one line naming the source (#46)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.config.data import DataConfig
from pipetrain.metrics import names
from pipetrain.parallel.dp import local_rows
from pipetrain.train.data import build_data
from pipetrain.train.hf_mix import MixedRows, MixPlan

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.pure


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def write(path: Path, letter: str, n: int) -> Path:
    """n documents of one letter: a token's byte tells its source (a -> web, c -> code)."""
    datasets.Dataset.from_dict({"text": [letter * (5 + i % 40) for i in range(n)]}).to_json(path)
    return path


def mixture(tmp_path: Path, weights=(0.7, 0.3), sizes=(400, 300), **knobs) -> DataConfig:
    web, code = write(tmp_path / "web.jsonl", "a", sizes[0]), write(tmp_path / "code.jsonl", "c", sizes[1])
    sources = [{"path": str(web), "weight": weights[0]}, {"path": str(code), "weight": weights[1]}]
    return DataConfig(name="datasets", sources=sources, **{"batch_size": 8, "seq_len": 16, "tokenizer": "byte",
                                                           "val_fraction": 0.0, **knobs})


def test_two_sources_at_0_7_and_0_3_give_0_7_of_the_tokens(tmp_path):
    src = build_data(mixture(tmp_path), seed=0, vocab_size=256)
    tokens = {"web": 0, "code": 0}
    counted = {"a": 0, "c": 0}
    step = 0
    while sum(tokens.values()) < 20_000:
        x, _ = src.batch(step)
        for name in tokens:
            tokens[name] += src.last_stats[f"{names.DATA_TOKENS}/{name}"]
        counted["a"] += int((x == ord("a")).sum())
        counted["c"] += int((x == ord("c")).sum())
        step += 1
    share = tokens["web"] / sum(tokens.values())
    assert abs(share - 0.7) <= 0.01, share
    # the tokens themselves agree: the byte 'a' only comes from web, 'c' only from code
    assert abs(counted["a"] / (counted["a"] + counted["c"]) - 0.7) <= 0.01


def test_step_k_is_a_pure_function_of_seed_and_k(tmp_path):
    cfg = mixture(tmp_path)
    ahead = build_data(cfg, seed=5, vocab_size=256)
    want = [ahead.batch(k) for k in range(40)]
    fresh = build_data(cfg, seed=5, vocab_size=256)
    for k in (37, 3, 0, 21):  # out of order: no step depends on having read the ones before it
        got = fresh.batch(k)
        assert torch.equal(got[0], want[k][0]) and torch.equal(got[1], want[k][1])
    other = build_data(cfg, seed=6, vocab_size=256)
    assert not torch.equal(other.batch(0)[0], want[0][0])


def test_each_source_reads_every_row_once_an_epoch_and_dp_ranks_never_share_one(tmp_path):
    src = build_data(mixture(tmp_path, sizes=(100, 60)), seed=1, vocab_size=256)
    assert isinstance(src, MixedRows)
    plan = src.plans["train"]
    rows = [s.num_rows("train") for s in src.sources]
    read: list[list[int]] = [[], []]
    halves: list[set[tuple[int, int]]] = [set(), set()]
    for step in range(60):
        source, counter = plan.rows(step)
        for i, m in zip(source, counter):
            read[i].append(int(src._order(int(i), "train", int(m // rows[i]))[m % rows[i]]))
        for half in (0, 1):
            keep = local_rows((torch.from_numpy(source), torch.from_numpy(counter)), half, 2)
            halves[half] |= {(int(i), int(m)) for i, m in zip(*keep)}
    for i in (0, 1):  # the counters run 0, 1, 2, ... and each epoch of R_i rows is a permutation of them
        first = read[i][:rows[i]]
        assert len(read[i]) > rows[i] and sorted(first) == list(range(rows[i]))
    assert not halves[0] & halves[1]


def test_the_plan_realises_any_weights_to_a_row_and_counts_only_grow():
    for weights, b in (((0.7, 0.3), 8), ((1, 2, 3), 4), ((0.98, 0.01, 0.01), 16), ((5.0,), 3)):
        plan = MixPlan(weights, batch_size=b, seed=0)
        p = np.asarray(weights) / sum(weights)
        seen = np.zeros(len(weights), dtype=np.int64)
        for step in range(4 * plan.group + 3):
            source, counter = plan.rows(step)
            for i in range(len(weights)):  # a source's counters continue where its last row left off
                mine = counter[source == i]
                assert np.array_equal(mine, seen[i] + np.arange(len(mine)))
                seen[i] += len(mine)
            rows = (step + 1) * b
            if (step + 1) % plan.group == 0:  # at a block's end every share is exact to a row
                assert (np.abs(seen - rows * p) <= 1).all(), (weights, step, seen)


def one_line(err: BaseException, *words: str) -> None:
    text = str(err)
    assert "\n" not in text and all(w in text for w in words), text


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
def test_bad_mixtures_are_one_line_naming_the_source(tmp_path):
    web = write(tmp_path / "web.jsonl", "a", 50)
    with pytest.raises(ValueError) as info:
        DataConfig(name="datasets", tokenizer="byte", sources=[{"path": str(web), "weight": 0.0}])
    one_line(info.value, str(web), "weight", "> 0")
    with pytest.raises(ValueError) as info:
        DataConfig(name="datasets", tokenizer="byte", path=str(web), sources=[{"path": str(web)}])
    one_line(info.value, "data.path and data.sources are exclusive")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "empty")
    with pytest.raises(ValueError) as info:
        DataConfig(name="datasets", tokenizer="byte", sources=[{"path": str(web)}, {"path": str(tmp_path / "empty")}])
    one_line(info.value, str(tmp_path / "empty"), "empty")
    short = tmp_path / "short.jsonl"
    datasets.Dataset.from_dict({"text": ["x"] * 3}).to_json(short)  # 6 tokens: no row of 17
    cfg = DataConfig(name="datasets", tokenizer="byte", batch_size=8, seq_len=16, val_fraction=0.0,
                     sources=[{"path": str(web)}, {"path": str(short)}])
    with pytest.raises(ValueError) as info:
        build_data(cfg, seed=0, vocab_size=256)
    one_line(info.value, str(short), "no rows", "data.seq_len")
    with pytest.raises(ValueError) as info:
        DataConfig(name="datasets", tokenizer="byte", sources=[{"path": str(web)}, {"path": str(web)}])
    one_line(info.value, "both named 'web'", "name")


def test_the_data_metrics_reach_the_row_and_the_console_line(tmp_path):
    from pipetrain.loggers.console import metrics_line
    from pipetrain.metrics.step import StepRecord

    src = build_data(mixture(tmp_path), seed=0, vocab_size=256)
    src.batch(0)
    row = StepRecord(step=1, loss=2.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens_per_s=1e3,
                     data=src.last_stats).row()
    assert {k: row[k] for k in row if k.startswith("data/")} == {
        "data/tokens": 128, "data/loss_tokens": 128, "data/padding": 0.0,
        "data/tokens/web": row["data/tokens/web"], "data/tokens/code": 128 - row["data/tokens/web"]}
    assert names.scalars(row)["data/tokens/web"] == row["data/tokens/web"]  # what wandb and TensorBoard plot
    line = metrics_line(row, 10, None)
    assert "| data 128 tok (loss 128, pad 0.0%) web " in line and " code " in line, line
