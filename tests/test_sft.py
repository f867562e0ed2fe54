"""data=sft (issue 46): chats rendered with the tokenizer folder's chat template token for token as
transformers' apply_chat_template, the loss on the assistant's tokens as its assistant_masks, whole samples
packed into rows with their loss flags, and bad data refused in one line naming the file and the row.

The reference is transformers itself on a real tokenizer folder (tests/_chat.py: a BPE trained here, a
ChatML template). Assistant spans: the template with `{% generation %}` gives transformers' own
return_assistant_tokens_mask; the same template without the marks (as most shipped templates are) must
give the same mask from our prefix rule (train/chat.py), so both are compared with transformers' mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _chat import CHATML, CHATML_GENERATION, chat_model, chat_tokenizer, chats, write_jsonl
from conftest import run_cli

from pipetrain.config.data import DataConfig
from pipetrain.train.chat import load_chat_template
from pipetrain.train.hf_build import build_hf_data
from pipetrain.train.hf_sft import hf_encoder, rendered, separator

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
datasets = pytest.importorskip("datasets")

@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


def reference(folder: Path, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """transformers' (input_ids, assistant_masks) of each row, with the {% generation %} template."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = []
    for r in rows:
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]},
                                         {"role": "assistant", "content": r["completion"]}]
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=CHATML_GENERATION)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


@pytest.mark.pure
@pytest.mark.parametrize("template", [CHATML_GENERATION, CHATML], ids=["generation-marks", "prefix-rule"])
def test_ids_and_assistant_mask_equal_transformers(tmp_path, template):
    folder = chat_tokenizer(tmp_path / "tok", template=template)
    rows = chats(40)
    want = reference(folder, rows)
    ds = datasets.Dataset.from_list([{"messages": r.get("messages"), "prompt": r.get("prompt"),
                                      "completion": r.get("completion")} for r in rows])
    got = [(ids, flags) for _, ids, flags in rendered(ds, load_chat_template(str(folder)), hf_encoder(str(folder)),
                                                       where="test", split="train", loss_on="assistant")]
    assert len(got) == len(want)
    for i, ((ids, flags), (ref_ids, ref_mask)) in enumerate(zip(got, want)):
        assert ids == ref_ids, f"row {i}: token ids differ from apply_chat_template"
        assert flags == ref_mask, f"row {i}: loss flags differ from transformers' assistant_masks"
        assert 0 < sum(flags) < len(flags)


@pytest.mark.pure
def test_rows_carry_the_samples_and_their_targets(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok")
    rows = chats(60)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    sep = separator(str(folder))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.convert_ids_to_tokens(sep) == "<|endoftext|>"  # EOS <|im_end|> ends every turn: not a separator
    for packing in (True, False):
        cfg = DataConfig(name="sft", path=str(tmp_path / "chat.jsonl"), tokenizer="hf", tokenizer_dir=str(folder),
                         batch_size=4, seq_len=384, packing=packing, val_fraction=0.0)
        data = build_hf_data(cfg, seed=0, vocab_size=400)
        assert "0 truncated" in data.description and "0 dropped" in data.description, data.description
        want = reference(folder, rows)
        samples = {tuple(ids): mask for ids, mask in want}
        seen = 0
        for step in range(data.steps_per_epoch):
            x, y = data.batch(step)
            for xr, yr in zip(x.tolist(), y.tolist()):
                # the row's samples: cut after each separator; each is a whole sample, its targets its mask
                row = xr + [sep]
                cuts = [0] + [i + 1 for i, t in enumerate(row) if t == sep]
                for a, b in zip(cuts, cuts[1:]):
                    ids = row[a:b - 1]
                    if not ids:
                        continue  # padding
                    mask = samples[tuple(ids)]
                    seen += 1
                    target = [(ids + [None])[j + 1] if mask[j + 1] else -1 for j in range(len(ids) - 1)]
                    assert yr[a:a + len(ids) - 1] == target
                    assert yr[a + len(ids) - 1] == -1  # the separator is no target
        assert seen >= 4 * data.steps_per_epoch
        assert data.last_stats["data/loss_tokens"] == int((y != -1).sum())


@pytest.mark.pure
def test_loss_on_all_and_overlong_samples(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "chat.jsonl", chats(40))
    base = dict(name="sft", path=str(tmp_path / "chat.jsonl"), tokenizer="hf", tokenizer_dir=str(folder),
                batch_size=2, seq_len=96, val_fraction=0.0)
    cut = build_hf_data(DataConfig(**base), seed=0, vocab_size=400)
    dropped = build_hf_data(DataConfig(**base, truncate=False), seed=0, vocab_size=400)
    assert "truncated to data.seq_len + 1 = 97 tokens" in cut.description
    assert "dropped: longer than data.seq_len + 1 = 97 tokens" in dropped.description
    with pytest.raises(ValueError, match="samples dropped as longer than data.seq_len \\+ 1 = 17 tokens\\): raise "
                                         "data.seq_len, set data.truncate=true or use more data"):
        build_hf_data(DataConfig(**{**base, "seq_len": 16}, truncate=False), seed=0, vocab_size=400)
    assert dropped.num_rows("train") < cut.num_rows("train")
    every = build_hf_data(DataConfig(**base, loss_on="all", packing=False), seed=0, vocab_size=400)
    x, y = every.batch(0)
    sep = separator(str(folder))
    for xr, yr in zip(x.tolist(), y.tolist()):  # a sample a row: every target up to its separator counts
        n = xr.index(sep) if sep in xr else len(xr) + 1  # a truncated sample has no separator in the row
        assert all(t != -1 for t in yr[:n - 1]) and all(t == -1 for t in yr[n - 1:])
    assert int((y != -1).sum()) > int((cut.batch(0)[1] != -1).sum())


def bad(tmp_path: Path, rows: list[dict], **knobs) -> str:
    folder = chat_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = dict(name="sft", path=str(tmp_path / "bad.jsonl"), tokenizer="hf", tokenizer_dir=str(folder),
               batch_size=1, seq_len=64, val_fraction=0.0, **knobs)
    with pytest.raises(ValueError) as e:
        build_hf_data(DataConfig(**cfg), seed=0, vocab_size=400)
    return str(e.value)


@pytest.mark.pure
def test_bad_data_is_one_line_naming_file_and_row(tmp_path):
    good = chats(3)
    msg = bad(tmp_path, [*good, {"messages": [{"role": "wizard", "content": "x"}]}])
    assert "bad.jsonl row 3" in msg and "unknown role 'wizard'" in msg and "\n" not in msg
    msg = bad(tmp_path, [*good, {"prompt": "only a prompt"}])
    assert "bad.jsonl row 3" in msg and "no 'messages'" in msg
    msg = bad(tmp_path, [*good, {"messages": [{"role": "user"}]}])
    assert "bad.jsonl row 3 of split 'train' message 0 is not {role, content}" in msg
    msg = bad(tmp_path, [*good, {"messages": [{"role": "user", "content": "x <|endoftext|> y"}]}])
    assert "row 3" in msg and "<|endoftext|>" in msg
    msg = bad(tmp_path, [{"text": "plain"}])  # row 0: checked by the config (DataConfig), before any process starts
    assert "bad.jsonl row 0 of split 'train' has no 'messages' and no 'prompt' + 'completion' (fields: text)" in msg


@pytest.mark.pure
def test_template_that_fails_and_folder_without_one(tmp_path):
    failing = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}" \
              "{% endif %}{{ m['content'] }}{% endfor %}"
    folder = chat_tokenizer(tmp_path / "tok", template=failing)
    write_jsonl(tmp_path / "c.jsonl", chats(4))
    cfg = DataConfig(name="sft", path=str(tmp_path / "c.jsonl"), tokenizer="hf", tokenizer_dir=str(folder),
                     batch_size=1, seq_len=64, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"c.jsonl row 0 of split 'train': the chat template fails to render it "
                                         r"\(TemplateError: no system turns\)"):
        build_hf_data(cfg, seed=0, vocab_size=400)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template .* add one there"):
        DataConfig(name="sft", path=str(tmp_path / "c.jsonl"), tokenizer="hf", tokenizer_dir=str(folder))
    with pytest.raises(ValueError, match="data=sft renders chats with a Hugging Face tokenizer's chat template"):
        DataConfig(name="sft", path=str(tmp_path / "c.jsonl"), tokenizer="byte")
    with pytest.raises(ValueError, match="data.loss_on is only read by data=sft"):
        DataConfig(name="datasets", path=str(tmp_path / "c.jsonl"), loss_on="all")


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_fine_tunes_a_tiny_hf_llama_on_chats_at_pp2(tmp_path):
    folder = chat_model(tmp_path / "tiny-chat-llama")
    write_jsonl(tmp_path / "chat.jsonl", chats(200))
    # the command: no model=, the folder's config.json names the family (config/finetune.py with_family)
    res = run_cli([f"model.pretrained={folder}", "data=sft", "data.path=chat.jsonl",
                   "pipeline.degree=2", "trainer.max_steps=3", "trainer.device=cpu", "trainer.ckpt_at_end=false",
                   "logger=[console,jsonl]", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                  env_extra={"HF_DATASETS_CACHE": str(tmp_path / "c")})
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step")]
    assert steps and all(0 < r["data/loss_tokens"] < r["data/tokens"] for r in steps if "data/loss_tokens" in r)
    assert np.isfinite([r["loss"] for r in steps if "loss" in r]).all()
