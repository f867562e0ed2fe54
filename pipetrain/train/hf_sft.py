"""data=sft: chat samples rendered with the tokenizer's chat template (train/chat.py), tokenized once into
a cached stream with a loss flag per token, and whole samples packed into rows.

The stream (hf_data.py's cache: the same key, lock and folder, keyed also by the template, data.loss_on
and the separator): sample s is its rendered tokens then SEP, the separator. train.bin holds the tokens,
train.loss a uint8 per token (1: a target of the loss, the assistant's tokens or with loss_on=all every
token of the sample; 0 for SEP), train.idx each sample's start (int64). Why a separator and not EOS: a
chat template ends every turn with a token that is often the tokenizer's EOS (Qwen's <|im_end|>, Llama 3's
<|eot_id|>), and document masks start a document after each EOS (runtime/documents.py), which would cut a
conversation into its turns. SEP is the first of EOS, the pad token and the other special tokens that the
template does not write into a probe conversation (`separator`); a sample that holds it is refused naming
its row. SEP's own target is never counted, nor the target crossing from one sample into the next.

The rows (PackedRows with spans): a row is whole samples, [start, end) of the stream, at most
seq_len + 1 tokens, the rest padded with SEP (padding is no target). With data.packing=true consecutive
samples share a row while they fit (next-fit, in the source's order, so the rows are a pure function of
the cache and seq_len); with packing=false a sample a row. A sample longer than seq_len + 1 tokens is cut
to its first seq_len + 1 (data.truncate=true) or dropped (false); a cut one left with no loss token is
dropped; the data's description counts both. Validation: data.val_split's samples, else the last
data.val_fraction of the samples. The rows' order per step is hf_data.py's (seeded epochs).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipetrain.config.data import DataConfig
from pipetrain.config.data_sources import SourceConfig
from pipetrain.config.hf_source import HFSource
from pipetrain.config.sft import chat_messages
from pipetrain.train.chat import ChatTemplate, assistant_mask, load_chat_template
from pipetrain.train.hf_data import ENCODE_BATCH, PackedRows, Spans, cached_stream
from pipetrain.train.tokenizer import TextTokenizer

PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def hf_encoder(tokenizer_dir: Optional[str]) -> Any:
    """The folder's `tokenizers.Tokenizer` (its offsets tell which tokens are the assistant's)."""
    from tokenizers import Tokenizer

    from pipetrain.config.data import find_hf_tokenizer

    return Tokenizer.from_file(str(find_hf_tokenizer(tokenizer_dir)))


def separator(tokenizer_dir: Optional[str]) -> int:
    """The id ending each sample (module docstring): EOS, pad, then the other special tokens by id, the
    first the template does not write into PROBE."""
    from pipetrain.config.sft import special_tokens

    import jinja2

    enc, template = hf_encoder(tokenizer_dir), load_chat_template(tokenizer_dir)
    used: set[int] = set()
    for probe in (PROBE, PROBE[1:]):  # a template may refuse system turns; the rows' own errors name theirs
        try:
            used = set(enc.encode(template.render(probe), add_special_tokens=False).ids)
            break
        except jinja2.TemplateError:
            continue
    named = special_tokens(tokenizer_dir or "")
    added = sorted((i, t) for i, t in enc.get_added_tokens_decoder().items() if t.special)
    for token in (named.get("eos_token"), named.get("pad_token"), *(t.content for _, t in added)):
        tid = enc.token_to_id(token) if token is not None else None
        if tid is not None and tid not in used:
            return tid
    raise ValueError(f"data.tokenizer_dir={tokenizer_dir}: its chat template writes every special token, leaving "
                     "none to end a sample in a packed row: set data.packing=false data.document_mask=false")


def write_sft_stream(cfg: DataConfig, source: HFSource, tok: TextTokenizer, out: Path) -> None:
    """Render, tokenize and flag data.split (and data.val_split) into out/{train,val}.{bin,loss,idx} + meta.json."""
    template, enc, sep = load_chat_template(cfg.tokenizer_dir), hf_encoder(cfg.tokenizer_dir), \
        separator(cfg.tokenizer_dir)
    dtype = np.dtype("<u2" if tok.vocab_size <= 1 << 16 else "<u4")
    meta: dict[str, Any] = {"path": cfg.path, "tokenizer": tok.name, "eos_id": sep, "dtype": dtype.str,
                            "loss_on": cfg.loss_on, "splits": {}}
    for split, name in ((cfg.split, "train"), *([(cfg.val_split, "val")] if cfg.val_split else [])):
        samples = tokens = loss_tokens = 0
        starts: list[int] = []
        with open(out / f"{name}.bin", "wb") as f, open(out / f"{name}.loss", "wb") as fl:
            for row, ids, flags in rendered(source.open(split), template, enc, where=f"data.path={cfg.path}",
                                            split=split, loss_on=cfg.loss_on):
                if sep in ids:
                    raise ValueError(f"data.path={cfg.path} row {row} of split {split!r} holds token {sep} "
                                     f"({enc.id_to_token(sep)}), which ends samples in packed rows: remove it from "
                                     "the sample, or set data.packing=false data.document_mask=false")
                starts.append(tokens)
                f.write(np.asarray([*ids, sep], dtype=dtype).tobytes())
                fl.write(np.asarray([*flags, 0], dtype=np.uint8).tobytes())
                samples, tokens, loss_tokens = samples + 1, tokens + len(ids) + 1, loss_tokens + sum(flags)
        if samples == 0:
            raise ValueError(f"data.path={cfg.path} split {split!r} holds no chat (no rows): give a source with chats")
        np.save(out / f"{name}.idx.npy", np.asarray(starts, dtype=np.int64))
        meta["splits"][name] = {"split": split, "samples": samples, "tokens": tokens, "loss_tokens": loss_tokens}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def rendered(ds: Any, template: ChatTemplate, enc: Any, *, where: str, split: str, loss_on: str):  # noqa: ANN201
    """(row, token ids, loss flags) of every sample of `ds`, in order (module docstring)."""
    row = 0
    for part in ds.iter(batch_size=ENCODE_BATCH):
        rows = [dict(zip(part, values)) for values in zip(*part.values())]
        texts, spans = [], []
        for i, r in enumerate(rows):
            at = f"{where} row {row + i} of split {split!r}"
            text, s = template.render_spans(chat_messages(r, where=at), where=at)
            texts.append(text)
            spans.append(s)
        for i, e in enumerate(enc.encode_batch(texts, add_special_tokens=False)):
            flags = [1] * len(e.ids) if loss_on == "all" else assistant_mask(e.offsets, spans[i])
            yield row + i, e.ids, flags
        row += len(rows)


def pack(starts: np.ndarray, end: int, loss: np.ndarray, *, seq_len: int, packing: bool,
         truncate: bool) -> tuple[Spans, dict[str, int]]:
    """Rows of whole samples (module docstring): (starts, ends) of the stream, and what was cut or dropped."""
    t1 = seq_len + 1
    ends = np.append(starts[1:], end)
    rows_s: list[int] = []
    rows_e: list[int] = []
    counts = {"truncated": 0, "dropped": 0}
    for s, e in zip(starts.tolist(), ends.tolist()):
        if e - s > t1:
            if not truncate or not loss[s + 1:s + t1].any():  # dropped, or cut to no loss token
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            e = s + t1
        if packing and rows_e and rows_e[-1] == s and e - rows_s[-1] <= t1:
            rows_e[-1] = e
        else:
            rows_s.append(s)
            rows_e.append(e)
    return (np.asarray(rows_s, dtype=np.int64), np.asarray(rows_e, dtype=np.int64)), counts


def sft_rows(cfg: DataConfig, source: SourceConfig, tok: TextTokenizer, *, seed: int, what: str,
             min_rows: Optional[int] = None) -> PackedRows:
    """One chat source's cached stream, memory-mapped, as rows of whole samples with their loss flags."""
    one = copy.copy(cfg)  # data.* with this source's path and split (not checked again)
    one.path, one.split, one.sources = source.path, source.split, []
    template = load_chat_template(cfg.tokenizer_dir)
    key = hashlib.sha256(json.dumps(["sft", 1, template.source, template.special, cfg.loss_on]).encode()).hexdigest()
    folder, meta = cached_stream(one, tok, writer=write_sft_stream, key=key)
    dtype = np.dtype(meta["dtype"])
    parts = {"train": np.memmap(folder / "train.bin", dtype=dtype, mode="r")}
    loss = {"train": np.memmap(folder / "train.loss", dtype=np.uint8, mode="r")}
    starts = {"train": np.load(folder / "train.idx.npy")}
    if (folder / "val.bin").is_file():
        parts["val"] = np.memmap(folder / "val.bin", dtype=dtype, mode="r")
        loss["val"] = np.memmap(folder / "val.loss", dtype=np.uint8, mode="r")
        starts["val"] = np.load(folder / "val.idx.npy")
    elif cfg.val_fraction > 0 and len(starts["train"]) > 1:  # the last val_fraction of the samples, whole
        n = len(starts["train"])
        cut = max(1, n - int(n * cfg.val_fraction))
        if cut < n:  # validation's samples are the tail of the training stream
            starts["val"], starts["train"] = starts["train"][cut:], starts["train"][:cut]
            parts["val"], loss["val"] = parts["train"], loss["train"]
    ends = {"train": int(starts["val"][0]) if "val" in starts and parts["val"] is parts["train"]
            else len(parts["train"]), "val": len(parts.get("val", ()))}
    spans: dict[str, Spans] = {}
    counted = {"truncated": 0, "dropped": 0}
    for split in starts:
        spans[split], counts = pack(starts[split], ends[split], loss[split], seq_len=cfg.seq_len,
                                    packing=cfg.packing, truncate=cfg.truncate)
        counted = {k: counted[k] + counts[k] for k in counted}
    least = cfg.batch_size if min_rows is None else min_rows
    if len(spans["train"][0]) < least:
        raise ValueError(f"{what}: {len(spans['train'][0]):,} training rows of whole samples, fewer than "
                         f"{'data.batch_size=' if min_rows is None else ''}{least} ({counted['dropped']:,} samples "
                         f"dropped as longer than data.seq_len + 1 = {cfg.seq_len + 1} tokens): raise data.seq_len"
                         f"{'' if cfg.truncate else ', set data.truncate=true'} or use more data")
    rows = PackedRows(parts, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed, packing=False,
                      eos_id=meta["eos_id"], what=what, name=source.label, min_rows=min_rows, spans=spans, loss=loss)
    cut = "truncated to" if cfg.truncate else "dropped: longer than"
    rows.description += (f"; {len(starts['train']):,} chat samples, loss on {cfg.loss_on}"
                         f"{' tokens' if cfg.loss_on == 'all' else ''}, {counted['truncated']:,} {cut} "
                         f"data.seq_len + 1 = {cfg.seq_len + 1} tokens, {counted['dropped']:,} dropped")
    return rows
