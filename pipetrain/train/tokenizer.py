"""Text -> token ids: the tokenizers `data.tokenizer` names, behind one small record.

`load_tokenizer(name, tokenizer_dir)` returns a `TextTokenizer` (vocabulary size, end-of-text
id, a batch encoder) for `byte` (one token per UTF-8 byte), `gpt2` (GPT-2's BPE through
tiktoken, built from a local encoder.json) and `hf` (a Hugging Face tokenizer.json through the
`tokenizers` package). Training on text (data=text, builtin) and pipetrain-prepare both use it.
Imports no torch: preparing shards never loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pipetrain.config.data import (
    BYTE_VOCAB, HF_BOS_NAMES, TOKENIZERS, find_gpt2_encoder, find_hf_tokenizer, hf_special,
)

# The byte tokenizer has no end-of-text token; NUL never occurs in text, so it separates
# documents without growing the 256-token vocabulary.
BYTE_EOS = 0
# Names an end-of-text token goes by, when tokenizer_config.json does not say (GPT-2 / Qwen,
# Llama 3 base, Llama 2 / Mistral, Gemma).
HF_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass(frozen=True)
class TextTokenizer:
    name: str  # byte | gpt2 | hf
    vocab_size: int  # every id it produces is below this
    eos_id: Optional[int]  # the end-of-text id written between documents (None: the tokenizer has none)
    encode_batch: Callable[[list[str]], list[list[int]]]  # texts -> ids, no special tokens added
    bos_id: Optional[int] = None  # the beginning-of-text id data.add_bos writes (None: the tokenizer has none)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def load_tokenizer(name: str, tokenizer_dir: Optional[str] = None) -> TextTokenizer:
    """The tokenizer `data.tokenizer=name` (with `data.tokenizer_dir`) names; one-line errors
    saying what to install or set when its package or files are missing."""
    if name == "byte":
        return TextTokenizer("byte", BYTE_VOCAB, BYTE_EOS, lambda texts: [list(t.encode("utf-8")) for t in texts])
    if name == "gpt2":
        enc = gpt2_encoding(tokenizer_dir)
        return TextTokenizer("gpt2", enc.n_vocab, enc.eot_token, enc.encode_ordinary_batch)
    if name == "hf":
        return hf_tokenizer(tokenizer_dir)
    raise ValueError(f"data.tokenizer={name!r} is unknown: choose one of {', '.join(TOKENIZERS)}")


def hf_tokenizer(tokenizer_dir: Optional[str]) -> TextTokenizer:
    """A Hugging Face tokenizer.json, its end-of-text token from tokenizer_config.json's
    `eos_token` when the folder has one, else the first of HF_EOS_NAMES it knows."""
    from tokenizers import Tokenizer  # a dependency; imported here so byte-only runs never load it

    path = find_hf_tokenizer(tokenizer_dir)
    tok = Tokenizer.from_file(str(path))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    ids = {key: hf_special(path, key, names) for key, names in (("eos_token", HF_EOS_NAMES),
                                                                  ("bos_token", HF_BOS_NAMES))}
    eos, bos = (tok.token_to_id(ids[k]) if ids[k] is not None else None for k in ("eos_token", "bos_token"))
    return TextTokenizer("hf", tok.get_vocab_size(with_added_tokens=True), eos, encode_batch, bos)


# GPT-2's pre-tokenisation pattern (openai/gpt-2 src/encoder.py; tiktoken's gpt2 encoding uses the same).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's encoder.json writes each byte as a printable character: the 188 printable
    Latin-1 bytes as themselves, the other 68 as chr(256 + n) in byte order (encoder.py,
    bytes_to_unicode). Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(BYTE_VOCAB) if b not in set(printable)]
    alphabet.update({chr(BYTE_VOCAB + n): b for n, b in enumerate(others)})
    return alphabet


def gpt2_encoding(tokenizer_dir: str | None = None) -> Any:
    """A tiktoken Encoding built from GPT-2's encoder.json found on this machine (see
    find_gpt2_encoder): the same ids as tiktoken.get_encoding("gpt2"), without its download."""
    import tiktoken  # optional: find_gpt2_encoder has checked it is installed

    path = find_gpt2_encoder(tokenizer_dir)
    alphabet = _gpt2_byte_alphabet()
    vocab = json.loads(path.read_text(encoding="utf-8"))
    eot = vocab.pop(GPT2_EOT, None)
    ranks = {bytes(alphabet[c] for c in token): rank for token, rank in vocab.items()}
    special = {GPT2_EOT: eot if eot is not None else len(ranks)}
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)
