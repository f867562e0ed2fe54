"""Mistakes that used to surface only after the ranks started (issue 25) now fail before any
process is spawned: while the config is composed, or in the launcher's checks (simulate_cmd's
plan_and_simulate, which every train and eval run goes through before `launch`)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

import pipetrain.train.token_check as data_schema
from pipetrain.config.shards import read_shard
from pipetrain.simulate_cmd import plan_and_simulate

pytestmark = pytest.mark.pure


def _error(compose, overrides, *, tokens: bool = False) -> str:
    """The one-line error of composing `overrides` (`tokens`: of the launcher's token-id check after it)."""
    with pytest.raises(ValueError) as info:
        config = compose(overrides)
        if tokens:
            data_schema.check_token_ids(config)
    err = info.value
    while err.__cause__ is not None:  # OmegaConf may wrap the __post_init__ error
        err = err.__cause__
    assert "\n" not in str(err)
    return str(err)


def _llmc_uint32(path, ids) -> None:
    """llm.c's uint32 shard (magic 20240801, version 7: Llama 3's 128k vocabulary)."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240801, 7, len(ids))
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=np.uint32).tobytes())


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_token_ids_beyond_the_vocabulary_fail_before_the_start(compose, tmp_path, mode):
    ids = np.arange(4096) % 500
    ids[3000] = 70_000  # beyond gpt2-tiny's 512 (and uint16)
    shard = tmp_path / "tokens.bin"
    _llmc_uint32(shard, ids)
    msg = _error(compose, [f"mode={mode}", "model=gpt2-tiny", "data=tokens", f"data.path={shard}", "data.seq_len=32"],
                 tokens=True)
    assert msg == (f"data.path={shard}: {shard} holds token id 70000 but model.vocab_size=512: set "
                   f"model.vocab_size >= 70001, or use tokens made with the model's tokenizer")


def test_eval_checks_the_file_it_reads(compose, tmp_path):
    """mode=eval reads data.val_path when set: a bad id there is named with that knob."""
    good, bad = tmp_path / "train.npy", tmp_path / "held_out.npy"
    np.save(good, (np.arange(4096) % 500).astype(np.uint32))
    np.save(bad, np.full(4096, 600, dtype=np.uint32))
    base = ["model=gpt2-tiny", "data=tokens", f"data.path={good}", f"data.val_path={bad}", "data.seq_len=32"]
    assert _error(compose, ["mode=eval", *base], tokens=True).startswith(
        f"data.val_path={bad}: {bad} holds token id 600")
    # a good file
    data_schema.check_token_ids(compose(["mode=train", "data.val_path=null", *base[:3], "data.seq_len=32"]))


def test_a_long_stream_is_sampled_end_to_end(tmp_path, monkeypatch):
    """Past FULL_SCAN_TOKENS the launcher samples runs spread over each shard, its first and last ids included."""
    monkeypatch.setattr(data_schema, "FULL_SCAN_TOKENS", 1000)
    n = data_schema.SAMPLE_RUNS * data_schema.SAMPLE_RUN_TOKENS + 12_345
    for where in (0, n - 1):
        ids = np.zeros(n, dtype=np.uint32)
        ids[where] = 99_999
        path = tmp_path / f"at{where}.npy"
        np.save(path, ids)
        assert data_schema.token_id_range([read_shard(path, knob="data.path")])[1] == (99_999, str(path))
        signed = tmp_path / f"signed{where}.npy"
        np.save(signed, -ids.astype(np.int64))  # a sampled -99,999 in an int64 file is found too
        assert data_schema.token_id_range([read_shard(signed, knob="data.path")])[0] == (-99_999, str(signed))


def test_a_negative_token_id_is_one_line_before_the_start(compose, tmp_path):
    """An int64 .npy holding -1 (a padding or ignore id) was accepted and a rank later failed with a
    bare IndexError (issue #44): the launcher refuses it, naming the file."""
    path = tmp_path / "ids.npy"
    ids = (np.arange(4096) % 500).astype(np.int64)
    ids[1234] = -1
    np.save(path, ids)
    error = _error(compose, ["mode=train", "model=gpt2-tiny", "data=tokens", f"data.path={path}", "data.seq_len=32"],
                   tokens=True)
    assert error == (f"data.path={path}: {path} holds token id -1: token ids must be >= 0; drop the negative ids "
                     f"(padding or ignore markers) from the token files"), error


def test_eval_on_the_builtin_corpus_fails_at_compose(compose):
    assert (_error(compose, ["mode=eval"])
            == "mode=eval reads token files or data=datasets' validation rows: set data=tokens data.path=FILE or "
               "data=datasets (got data=builtin)")


def test_a_profile_folder_that_is_a_file_fails_before_the_start(compose, tmp_path):
    (tmp_path / "profile").write_text("mine\n")
    config = compose(["model=sleep", "profile.enabled=true", "trainer.max_steps=3"])
    with pytest.raises(ValueError) as info:
        plan_and_simulate(config, tmp_path, Console(file=io.StringIO()), timeline=False, write=False)
    assert str(info.value) == (f"profile.enabled=true writes profile/rank<r>.json into {tmp_path / 'profile'}, which "
                               f"is a file: move that file away, or set hydra.run.dir to another directory (or "
                               f"profile.enabled=false)")
    assert (tmp_path / "profile").read_text() == "mine\n"


def test_cp_rotate_without_context_parallel_is_one_line(compose):
    """#44: parallel.cp_rotate=ring at cp=1 was accepted and did nothing; the planner may still price
    plan.cp's rows with it (and applies a cp=1 row with the default)."""
    assert _error(compose, ["model=llama-tiny", "parallel.cp_rotate=ring"]) == (
        "parallel.cp_rotate=ring passes K/V between context-parallel ranks, which this run has none of "
        "(parallel.cp=1): set parallel.cp > 1 or drop parallel.cp_rotate")
    compose(["model=llama-tiny", "parallel.cp_rotate=ring", "mode=plan", "plan.cp=[1,2]", "data.seq_len=64"])


def test_a_model_too_large_for_host_memory_is_refused_before_the_start(compose):
    """#44: a CPU run of a model larger than the machine ended in every rank's
    "DefaultCPUAllocator: can't allocate memory" with no word of what to change. Refused before
    any rank starts, from the plan's parameter count (16 bytes each: weight, gradient, AdamW)."""
    from pipetrain.launch.host_memory import available_bytes, check_host_memory
    from pipetrain.plan import make_plan

    config = compose(["model=llama3.1-8b", "trainer.device=cpu", "pipeline.degree=2", "data.seq_len=64"])
    plan = make_plan(config)
    params = sum(plan.partition.chunk_params())
    with pytest.raises(ValueError) as info:
        check_host_memory(config, plan, available=16 * params - 1)
    assert str(info.value) == (
        f"model=llama3.1-8b needs at least {16 * params / 1e9:.1f} GB of host memory for its weights, gradients and "
        f"AdamW state (16 bytes x {params / 1e6:,.1f}M parameters) but this machine has {(16 * params - 1) / 1e9:.1f} "
        "GB available: use a smaller model (or data.batch_size / data.seq_len for the activations), spread the ranks "
        "over machines (cluster=slurm), or train on GPUs (trainer.device=cuda)")
    check_host_memory(config, plan, available=16 * params)  # fits
    assert available_bytes() is None or available_bytes() > 0  # this machine's MemAvailable, read for real
    tiny = compose(["model=gpt2-tiny", "trainer.device=cpu"])
    check_host_memory(tiny, make_plan(tiny))  # the quickstart's model fits any machine


def test_a_ranks_host_out_of_memory_says_what_to_change():
    """torch's own error for an allocation the host cannot hold, made for real, becomes one line."""
    import torch

    from pipetrain.launch.errors import one_line

    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 48, dtype=torch.uint8)  # 256 TiB
    assert one_line(info.value) == (
        f"out of host memory (allocating {(1 << 48) / 1e9:.2f} GB): use a smaller model (or data.batch_size / "
        "data.seq_len for the activations), spread the ranks over machines (cluster=slurm), or train on GPUs "
        "(trainer.device=cuda)")
