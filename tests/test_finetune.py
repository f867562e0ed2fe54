"""The fine-tune path (`model.pretrained=DIR`, issue 44): text is tokenized with the folder's
tokenizer.json unless data.tokenizer is set, token shards made by another tokenizer are refused in
one line, and the optimizer takes fine-tune defaults (lr 2e-5, warm-up 3%, cosine to 10%) unless set.
A real HF folder (a tiny Llama written by transformers) with a real tokenizer.json (a byte-level
BPE trained here with the `tokenizers` library on a few lines)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from test_prepare import SENTENCES, tiny_tokenizer

from pipetrain.prepare import prepare
from pipetrain.train.data import build_data, builtin_corpus

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320  # the model's: the tokenizer's 256 bytes + merges + 2 specials fit


def byte_bpe(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json (every text encodes, no <unk>) trained on SENTENCES, with an EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, with a trained tokenizer.json."""
    folder = tmp_path_factory.mktemp("ft") / "tiny-llama"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True))
    hf.save_pretrained(folder)
    byte_bpe(folder)
    return folder


def windows_of(stream: np.ndarray, rows: torch.Tensor) -> bool:
    """Whether every row is a run of consecutive ids of `stream`."""
    view = np.lib.stride_tricks.sliding_window_view(stream, rows.shape[1])
    return all(bool((view == row.numpy()).all(axis=1).any()) for row in rows)


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
@pytest.mark.pure
def test_builtin_corpus_is_tokenized_with_the_folders_tokenizer(hf_folder, compose):
    from tokenizers import Tokenizer

    config = compose(["model=llama-tiny", f"model.pretrained={hf_folder}", "mode=train"])
    assert (config.data.tokenizer, config.data.tokenizer_dir) == ("hf", str(hf_folder))
    ids = np.asarray(Tokenizer.from_file(str(hf_folder / "tokenizer.json")).encode(
        builtin_corpus().decode(), add_special_tokens=False).ids)
    assert ids.max() >= 256  # merges in use: not byte ids
    # what a rank trains on: the Trainer's data source, built from config.data as trainer.py builds it
    source = build_data(config.data, seed=config.trainer.seed, vocab_size=config.model.vocab_size)
    assert np.array_equal(np.asarray(source.tokens), ids)
    x, y = source.batch(0)  # optimizer step 1's batch
    assert x.shape == (config.data.batch_size, config.data.seq_len)
    assert windows_of(ids, x) and windows_of(ids, y) and torch.equal(x[:, 1:], y[:, :-1])
    # a folder without tokenizer.json keeps byte tokens; a tokenizer set by the user wins
    bare = hf_folder.parent / "bare"
    shutil.copytree(hf_folder, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    assert compose(["model=llama-tiny", f"model.pretrained={bare}"]).data.tokenizer == "byte"
    own = compose(["model=llama-tiny", f"model.pretrained={hf_folder}", "data.tokenizer=byte"])
    assert own.data.tokenizer == "byte"
    assert compose(["model=llama-tiny"]).data.tokenizer == "byte"  # no folder: as before


@pytest.mark.pure
def test_fine_tune_defaults_apply_unless_set(hf_folder, compose):
    base = ["model=llama-tiny", f"model.pretrained={hf_folder}", "trainer.max_steps=200"]
    optim = compose(base).optim
    assert (optim.lr, optim.min_lr, optim.warmup_steps) == (2e-5, pytest.approx(2e-6), 6)  # 3% of 200
    assert optim.defaulted == ["optim.lr=2e-05", "optim.min_lr=2e-06", "optim.warmup_steps=6"]
    assert compose([*base[:2], "trainer.max_steps=10"]).optim.warmup_steps == 1  # at least one step
    optim = compose([*base, "optim.lr=1e-4"]).optim  # an explicit lr wins; min_lr follows it to 10%
    assert (optim.lr, optim.min_lr, optim.warmup_steps) == (1e-4, pytest.approx(1e-5), 6)
    assert optim.defaulted == ["optim.min_lr=1e-05", "optim.warmup_steps=6"]
    optim = compose([*base, "optim.lr=1e-4", "optim.min_lr=0", "optim.warmup_steps=0"]).optim
    assert (optim.lr, optim.min_lr, optim.warmup_steps, optim.defaulted) == (1e-4, 0, 0, [])
    optim = compose(["model=llama-tiny"]).optim  # pre-training: today's defaults
    assert (optim.lr, optim.min_lr, optim.warmup_steps, optim.defaulted) == (3e-3, 3e-4, 5, [])


@pytest.mark.pure
def test_token_shards_of_another_tokenizer_are_refused_in_one_line(hf_folder, compose, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(SENTENCES) * 20)
    other, mine = tmp_path / "other", tmp_path / "mine"
    prepare([str(corpus)], str(other), tokenizer="hf", tokenizer_dir=str(tiny_tokenizer(tmp_path / "tok")),
            val_min_tokens=20, note=lambda _: None)
    prepare([str(corpus)], str(mine), tokenizer="hf", tokenizer_dir=str(hf_folder), val_min_tokens=20,
            note=lambda _: None)
    record = json.loads((other / "tokenized_by.json").read_text())
    assert record["tokenizer"] == "hf" and len(record["sha256"]) == 64
    base = ["model=llama-tiny", f"model.pretrained={hf_folder}", "mode=train", "data=tokens", "data.seq_len=8",
            "data.batch_size=8"]
    with pytest.raises(ValueError) as err:
        compose([*base, f"data.path={other}"])
    msg = str(err.value)
    assert "\n" not in msg and f"data.path={other}" in msg and "made by tokenizer hf" in msg, msg
    assert f"pipetrain-prepare --tokenizer hf --tokenizer-dir {hf_folder}" in msg, msg
    compose([*base, f"data.path={mine}"])  # the folder's own tokenizer: accepted
    # no record (e.g. a nanoGPT .bin): accepted, and the header says it was not checked
    plain = tmp_path / "plain"
    plain.mkdir()
    np.arange(200, dtype=np.uint16).tofile(plain / "train.bin")
    from pipetrain.config.finetune import header_lines

    config = compose([*base, f"data.path={plain}"])
    lines = header_lines(config.model.pretrained, config.data, config.optim)
    assert f"tokenizer: hf ({hf_folder / 'tokenizer.json'}, from model.pretrained)" in lines, lines
    assert any(str(plain) in line and "not checked" in line for line in lines), lines


@pytest.mark.e2e
def test_cli_header_names_the_tokenizer_and_the_defaults(hf_folder, tmp_path):
    res = run_cli(["model=llama-tiny", f"model.pretrained={hf_folder}", "trainer.max_steps=2", "trainer.device=cpu",
                   "trainer.ckpt_at_end=false", "logger=[console]", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert f"tokenizer: hf ({hf_folder / 'tokenizer.json'}, from model.pretrained)" in out, out
    assert ("fine-tune defaults: optim.lr=2e-05 optim.min_lr=2e-06 optim.warmup_steps=1 (model.pretrained; set "
            "them to override)") in out, out
    assert "step 1/2" in out and "lr 2.0e-05" in out, out  # warm-up of 1 step: step 1 trains at the peak


@pytest.mark.pure
def test_a_folder_alone_names_its_family(hf_folder, compose, tmp_path):
    """#46's command `pipetrain model.pretrained=DIR data=sft ...` names no model=: the folder's
    config.json model_type picks the preset that carries its family, whose knobs config.json then sets;
    a model= or a recipe on the command line is left to decide, and a folder without config.json too."""
    from pipetrain.config.finetune import with_family

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB).save_pretrained(gpt2)
    mixtral = tmp_path / "mixtral"
    transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, vocab_size=VOCAB).save_pretrained(mixtral)
    args = ["mode=simulate", f"model.pretrained={hf_folder}"]
    assert with_family(args) == [*args, "model=llama-tiny"]
    assert with_family([f"model.pretrained={gpt2}"])[-1] == "model=gpt2"
    assert with_family([f"model.pretrained={mixtral}"])[-1] == "model=moe-tiny"
    for named in (["model=llama3.2-1b"], ["+recipe=qwen3-0.6b"]):
        assert with_family([*args, *named]) == [*args, *named]
    assert with_family([f"model.pretrained={tmp_path}"]) == [f"model.pretrained={tmp_path}"]  # no config.json
    config = compose(with_family(args))
    assert (config.model.hidden_size, config.model.num_hidden_layers) == (32, 2), "config.json sets the shape"
