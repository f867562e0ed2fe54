"""Schema of the `data` config group: where batches come from, checked before any process starts.

Pure Python (no torch, no numpy): the root schema (pipetrain/config/) imports this and must stay importable
without them. A missing file, a file too short for one window, or a tokenizer whose files are
not on this machine fails here, in `__post_init__`, with a one-line error naming the knob,
so nothing is spawned for a run that could not load its data. The loaders are in
pipetrain/train/data.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipetrain.config.data_sources import SourceConfig, as_sources, check_sources
from pipetrain.config.shards import Shard, find_shards

# builtin: the corpus shipped in the package (pipetrain/train/corpus/); text: any text file;
# tokens: token shards (nanoGPT's or llm.c's .bin, .npy; a file, folder or glob, see shards.py);
# synthetic: random data, for benchmarks; datasets: Hugging Face `datasets` (files, folders, hub names),
# documents packed into rows (config/hf_source.py, train/hf_data.py); sft: chat data through `datasets`, rendered with
# the tokenizer's chat template, trained on the assistant's tokens (config/sft.py, train/hf_sft.py).
DATA_SOURCES = ("builtin", "text", "tokens", "synthetic", "datasets", "sft")
HF_DATA = ("datasets", "sft")  # the sources read through Hugging Face `datasets`, with data.path or data.sources
# byte: one token per UTF-8 byte; gpt2: GPT-2's BPE through tiktoken; hf: a Hugging Face
# tokenizer.json through the `tokenizers` package (Llama 3, Qwen, Mistral, ...).
TOKENIZERS = ("byte", "gpt2", "hf")
HF_TOKENIZER = "tokenizer.json"
BYTE_VOCAB = 256
# Names a beginning-of-text token goes by, when tokenizer_config.json does not say (Llama 3, Llama 2 /
# Mistral, Gemma). GPT-2 and Qwen have none (GPT-2 reuses <|endoftext|>; data.add_bos refuses them).
HF_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
GPT2_VOCAB = 50257  # 50,000 merges + 256 bytes + <|endoftext|>
# GPT-2's released vocabulary: token (in GPT-2's byte-to-unicode alphabet) -> id. Its ids are the
# BPE merge ranks (tiktoken checks that vocab.bpe agrees with it), so it alone defines the encoding.
GPT2_ENCODER = "encoder.json"
# tiktoken caches a downloaded file under the sha1 of its URL (tiktoken/load.py, read_file_cached);
# the URL is spelled differently across tiktoken versions, so each spelling is tried.
_GPT2_ENCODER_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "az://openaipublic/gpt-2/encodings/main/encoder.json",
)


@dataclass
class DataConfig:
    """What the model trains on. The batch of optimizer step k is a pure function of
    (trainer.seed, k, split): a resumed run sees exactly the data it would have seen."""

    name: str = "builtin"  # builtin | text | tokens | synthetic | datasets | sft
    # the global batch: sequences per optimizer step, split over dp pipelines x pipeline.microbatches
    batch_size: int = 16
    seq_len: int = 64  # tokens per sequence (GPT-2: <= model.block_size); short enough for a CPU step
    path: Optional[str] = None  # data=text: a text file; data=tokens: a token file, a folder of shards or a glob
    # data=tokens: validation shards (a file, folder or glob); then nothing of data.path is held out
    val_path: Optional[str] = None
    # byte (vocab 256, needs nothing) | gpt2 (tiktoken + GPT-2's files) | hf (a tokenizer.json); null: hf with
    # model.pretrained's tokenizer.json when the folder has one, else byte (chosen in config/finetune.py)
    tokenizer: Optional[str] = None
    tokenizer_dir: Optional[str] = None  # gpt2: a folder with GPT-2's encoder.json; hf: a folder with tokenizer.json
    val_fraction: float = 0.1  # the last 10% of the tokens are held out for the validation loss
    # data=datasets (config/hf_source.py, train/hf_data.py):
    split: str = "train"  # data=datasets: the split of data.path trained on
    text_field: str = "text"  # data=datasets: the field holding each document's text
    val_split: Optional[str] = None  # data=datasets: validation's split; null: the last val_fraction of the documents
    # data=datasets: true: documents joined by EOS into one stream, cut into rows of seq_len + 1 tokens;
    # false: a row per document (its first seq_len + 1 tokens, the rest of the row padded and not trained on)
    packing: bool = True
    add_bos: bool = False  # data=datasets: the tokenizer's BOS before each document (refused where it has none)
    # data=datasets: a mixture instead of data.path, [{path: A, weight: 0.7}, {path: B, weight: 0.3}] (each may set
    # split, text_field, name); weight_i / sum is source i's share of the rows (config/data_sources.py)
    sources: list[SourceConfig] = field(default_factory=list)
    # data=datasets: read documents through `datasets` streaming, packed on the fly, the position saved in each
    # checkpoint (train/hf_stream.py); null: true for a hub name or files over 1 GiB (data_sources.STREAM_BYTES)
    streaming: Optional[bool] = None
    # attention within each document of a packed row (block-causal, positions restarting per document; documents
    # end at EOS: runtime/documents.py); null: true for data=datasets with packing, the data with such rows
    document_mask: Optional[bool] = None
    # data=sft (config/sft.py): the tokens the loss is on, assistant (the assistant's turns as the chat template
    # renders them) | all (every token of a sample)
    loss_on: str = "assistant"
    # data=sft: a sample longer than seq_len + 1 tokens: true: its first seq_len + 1 tokens kept, false: dropped
    # (either counted in the data's description)
    truncate: bool = True

    def __post_init__(self) -> None:
        self.sources = as_sources(self.sources)
        if self.name not in DATA_SOURCES:
            raise ValueError(f"data={self.name!r} is unknown: choose data= one of {', '.join(DATA_SOURCES)}")
        for knob in ("batch_size", "seq_len"):
            if getattr(self, knob) < 1:
                raise ValueError(f"data.{knob} must be >= 1 (got {getattr(self, knob)})")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1) (got {self.val_fraction}): e.g. 0.1 holds out 10%")
        if self.tokenizer is not None and self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is unknown: choose one of {', '.join(TOKENIZERS)}")
        if self.tokenizer_dir is not None and self.tokenizer_name == "byte":
            raise ValueError("data.tokenizer_dir is only read by data.tokenizer=gpt2 or data.tokenizer=hf: "
                             "set one of them or drop data.tokenizer_dir")
        self._check_datasets_knobs()
        if self.val_path is not None and self.name != "tokens":
            raise ValueError(f"data.val_path is only read by data=tokens (got data={self.name}): "
                             "set data=tokens or drop data.val_path")
        self._check_path()
        if self.uses_tokenizer and self.tokenizer == "gpt2":
            find_gpt2_encoder(self.tokenizer_dir)  # raises, saying what to install and where the file goes
        if self.uses_tokenizer and self.tokenizer == "hf":
            find_hf_tokenizer(self.tokenizer_dir)

    @property
    def tokenizer_name(self) -> str:
        """data.tokenizer, byte where it was left unset (null) and nothing chose another."""
        return self.tokenizer or "byte"

    def use_tokenizer(self, name: str, tokenizer_dir: Optional[str]) -> None:
        """Set data.tokenizer and data.tokenizer_dir (a default the root schema chose) and check again."""
        self.tokenizer, self.tokenizer_dir = name, tokenizer_dir
        self.__post_init__()

    @property
    def uses_tokenizer(self) -> bool:
        """Whether text is tokenised (builtin, text); tokens files and synthetic data are ids already."""
        return self.name in ("builtin", "text", *HF_DATA)

    @property
    def file(self) -> Path:
        """data.path with ~ expanded (data=text, tokens and datasets only)."""
        if self.path is None:
            raise ValueError(f"data={self.name} reads no file")
        return Path(os.path.expanduser(self.path))

    def _check_datasets_knobs(self) -> None:
        """data=datasets' own knobs (data=sft's too): left at their defaults by every other source."""
        from pipetrain.config.sft import check_sft_knobs

        check_sft_knobs(self)
        if self.name in HF_DATA:
            for knob in ("split", "text_field"):
                if not getattr(self, knob):
                    raise ValueError(f"data.{knob} must name a split / field of data.path (got an empty string)")
            if self.val_split is not None and self.val_split == self.split:
                raise ValueError(f"data.val_split={self.val_split} is data.split too: validation would train on "
                                 "its own rows; name another split, or null to hold out data.val_fraction")
            return
        changed = [k for k, v in (("split", "train"), ("text_field", "text"), ("val_split", None), ("packing", True),
                                  ("add_bos", False), ("sources", []), ("streaming", None)) if getattr(self, k) != v]
        if changed:
            raise ValueError(f"data.{changed[0]} is only read by data=datasets (got data={self.name}): set "
                             f"data=datasets or drop data.{changed[0]}")

    @property
    def masks_documents(self) -> bool:
        """Whether attention stays within each document (data.document_mask, its null resolved)."""
        return self.document_mask if self.document_mask is not None else self.name in HF_DATA and self.packing

    def check_document_mask(self, *, model: str, family: str, compile: bool = False) -> None:
        """data.document_mask: documents that end at an EOS id the tokenizer names, a model whose attention reads
        them (GPT-2's, Llama's: runtime/documents.py; under context parallel too: parallel/cp.py), no
        trainer.compile (torch 2.13's Inductor crashed on AVX2 CPUs compiling the masked blocks: #46)."""
        if not (self.name in HF_DATA or (self.name == "tokens" and self.tokenizer is not None)):
            raise ValueError(f"data.document_mask=true needs documents that end at the tokenizer's EOS id: "
                             f"data=datasets, or data=tokens with the data.tokenizer that wrote them (got "
                             f"data={self.name}, data.tokenizer={self.tokenizer}): set data.document_mask=false")
        if family not in ("gpt2", "llama", "deepseek"):
            raise ValueError(f"data.document_mask=true: model={model} has no attention to keep within documents: "
                             f"set data.document_mask=false")
        if compile:
            raise ValueError("trainer.compile=true with data.document_mask: Inductor's compiled block with "
                             "per-document RoPE positions crashed (segfault) on AVX2 CPUs and is unchecked on CUDA: "
                             "set trainer.compile=false or data.document_mask=false")

    def check_tokenizer(self) -> None:
        """What the chosen data.tokenizer must have: a BOS for data.add_bos, a chat template for data=sft."""
        from pipetrain.config.sft import check_sft_tokenizer

        self.check_bos()
        check_sft_tokenizer(self)

    def check_bos(self) -> None:
        """data.add_bos=true needs a tokenizer with a beginning-of-text token: one line where it has none."""
        if not (self.name == "datasets" and self.add_bos):
            return
        if self.tokenizer_name == "hf" and hf_special(find_hf_tokenizer(self.tokenizer_dir), "bos_token",
                                                      HF_BOS_NAMES) is not None:
            return
        where = f" ({self.tokenizer_dir})" if self.tokenizer_dir else ""
        raise ValueError(f"data.add_bos=true but data.tokenizer={self.tokenizer_name}{where} has no beginning-of-text "
                         "token: set data.add_bos=false (documents are still separated by EOS)")

    def _check_path(self) -> None:
        if self.name not in ("text", "tokens", *HF_DATA):
            if self.path is not None:
                raise ValueError(
                    f"data.path is only read by data=text, tokens, datasets or sft (got data={self.name}): "
                    "set one of them, or drop data.path"
                )
            return
        if self.name in HF_DATA:
            check_sources(self)
            if self.tokenizer is not None:  # null: the root schema chooses it, then calls check_tokenizer
                self.check_tokenizer()
            return
        if not self.path:
            kind = "a text file" if self.name == "text" else "token shards (a .bin / .npy file, a folder or a glob)"
            raise ValueError(f"data={self.name} needs {kind}: add data.path=/path/to/file")
        if self.name == "tokens":
            train, val = self.token_shards()
            self.check_length(sum(s.count for s in train), sum(s.count for s in val) if val else None)
            return
        path = self.file
        if not path.is_file():
            why = "it is a folder" if path.is_dir() else "no such file"
            where = "" if path.is_absolute() else f" (relative to {os.getcwd()})"
            raise FileNotFoundError(f"data.path={self.path} does not exist: {why}{where}")
        size = path.stat().st_size
        if self.tokenizer_name == "byte":  # one token per byte; BPE lengths are known only after encoding
            self.check_length(size)
        elif size == 0:
            raise ValueError(f"data.path={self.path} is empty")

    def token_shards(self) -> tuple[list[Shard], list[Shard]]:
        """data=tokens: (training shards, validation shards), in order. The validation shards are
        data.val_path's, else a data.path folder's val-named ones (val.bin, *_val_*.bin), else none
        (then data.val_fraction of the training stream is held out)."""
        assert self.name == "tokens" and self.path, "token_shards is for data=tokens"
        train, val = find_shards(self.path, knob="data.path")
        if self.val_path is not None:
            val_train, val_val = find_shards(self.val_path, knob="data.val_path")
            val = val_train + val_val
        return train, val

    def tokenizer_vocab(self) -> Optional[int]:
        """Token ids a BPE tokenizer (gpt2, hf) can produce: the model's vocabulary must hold them.
        None for byte tokens (checked against the ids actually read) and for token data."""
        if not self.uses_tokenizer or self.tokenizer_name == "byte":
            return None
        if self.tokenizer == "gpt2":
            return GPT2_VOCAB
        return hf_vocab_size(find_hf_tokenizer(self.tokenizer_dir))

    def check_vocab_fits(self, vocab_size: int) -> None:
        """A one-line error when the tokenizer's ids do not all fit model.vocab_size."""
        need = self.tokenizer_vocab()
        if need is not None and need > vocab_size:
            where = f" ({self.tokenizer_dir})" if self.tokenizer_dir else ""
            raise ValueError(f"data.tokenizer={self.tokenizer_name}{where} has {need:,} tokens but model.vocab_size="
                             f"{vocab_size}: set model.vocab_size >= {need} or use a tokenizer that fits the model")

    def check_length(self, num_tokens: int, val_tokens: Optional[int] = None) -> None:
        """Both splits must hold at least one window of seq_len + 1 tokens (inputs and the
        target shifted by one); a one-line error naming the knobs otherwise. `val_tokens`:
        the size of separate validation shards (then nothing of the `num_tokens` is held out)."""
        need = self.seq_len + 1
        what = f"data.path={self.path}" if self.path else f"data={self.name}"
        if val_tokens is not None:
            for knob, spec, n in (("data.path", self.path, num_tokens), ("data.val_path", self.val_path, val_tokens)):
                if n < need:
                    shards = f"{knob}={spec}" if spec else f"the validation shards of data.path={self.path}"
                    raise ValueError(f"{shards} holds {n:,} tokens, too few for one window of data.seq_len="
                                     f"{self.seq_len} (needs >= {need:,}): lower data.seq_len or use more data")
            return
        train, val = split_sizes(num_tokens, self.val_fraction)
        if train >= need and (self.val_fraction == 0 or val >= need):
            return
        raise ValueError(
            f"{what} holds {num_tokens:,} tokens, too few for data.seq_len={self.seq_len} with "
            f"data.val_fraction={self.val_fraction} (train {train:,}, val {val:,}; each split needs >= {need:,}): "
            "lower data.seq_len or data.val_fraction, or use more data"
        )



def split_sizes(num_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts: the last `val_fraction` of the token stream is held out,
    so no window of one split ever reads a token of the other."""
    val = int(num_tokens * val_fraction)
    return num_tokens - val, val


def _tiktoken_cache_dirs() -> list[Path]:
    """Where tiktoken looks for cached files, in its own order (tiktoken/load.py): an explicit
    $TIKTOKEN_CACHE_DIR or $DATA_GYM_CACHE_DIR, else the default of newer (~/.cache/tiktoken)
    and older (<tmp>/data-gym-cache) versions."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return [Path(os.environ[var])] if os.environ[var] else []
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(xdg) / "tiktoken", Path(tempfile.gettempdir()) / "data-gym-cache"]


def find_gpt2_encoder(tokenizer_dir: Optional[str] = None) -> Path:
    """Local path of GPT-2's encoder.json: in `data.tokenizer_dir`, else in tiktoken's cache.
    Nothing is downloaded; a one-line error says what to install and where to put the file
    when tiktoken or the file is missing."""
    if importlib.util.find_spec("tiktoken") is None:
        raise ValueError(
            "data.tokenizer=gpt2 needs the tiktoken package: pip install tiktoken (or use data.tokenizer=byte)"
        )
    if tokenizer_dir is not None:
        path = Path(os.path.expanduser(tokenizer_dir)) / GPT2_ENCODER
        if path.is_file():
            return path
        raise FileNotFoundError(f"data.tokenizer_dir={tokenizer_dir} must hold GPT-2's {GPT2_ENCODER} (no {path})")
    keys = [hashlib.sha1(url.encode()).hexdigest() for url in _GPT2_ENCODER_URLS]
    for cache in _tiktoken_cache_dirs():
        for key in keys:
            if (cache / key).is_file():
                return cache / key
    looked = ", ".join(str(p) for p in _tiktoken_cache_dirs()) or "nowhere: $TIKTOKEN_CACHE_DIR is empty"
    raise FileNotFoundError(
        f"data.tokenizer=gpt2 needs GPT-2's {GPT2_ENCODER} on this machine (nothing is downloaded; looked in "
        f"tiktoken's cache: {looked}): put it in a folder and set data.tokenizer_dir=FOLDER, or set "
        "TIKTOKEN_CACHE_DIR to a copied tiktoken cache that holds the gpt2 encoding, or use data.tokenizer=byte"
    )


def find_hf_tokenizer(tokenizer_dir: Optional[str]) -> Path:
    """Local path of a Hugging Face tokenizer.json in `data.tokenizer_dir`; a one-line error
    saying what to install or set when the package or the file is missing."""
    if importlib.util.find_spec("tokenizers") is None:
        raise ValueError("data.tokenizer=hf needs the tokenizers package: pip install tokenizers")
    if tokenizer_dir is None:
        raise ValueError(f"data.tokenizer=hf needs a folder with {HF_TOKENIZER}: add data.tokenizer_dir=DIR "
                         "(e.g. a Hugging Face model folder)")
    path = Path(os.path.expanduser(tokenizer_dir)) / HF_TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer_dir={tokenizer_dir} must hold {HF_TOKENIZER} (no {path}): "
                                "point it at a Hugging Face model folder")
    return path


def hf_special(tokenizer_json: Path, key: str, names: tuple[str, ...]) -> Optional[str]:
    """The special token `key` (bos_token, eos_token) of a tokenizer.json, read as plain JSON: the one its
    folder's tokenizer_config.json names, else the first of `names` it holds; None if it has none."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    held = {t["content"] for t in spec.get("added_tokens") or []}
    vocab = (spec.get("model") or {}).get("vocab") or {}
    held |= set(vocab) if isinstance(vocab, dict) else {v[0] for v in vocab}  # Unigram: [token, score] pairs
    config = tokenizer_json.parent / "tokenizer_config.json"
    named = json.loads(config.read_text(encoding="utf-8")).get(key) if config.is_file() else None
    named = named.get("content") if isinstance(named, dict) else named
    return next((n for n in (named, *names) if n is not None and n in held), None)


def hf_vocab_size(tokenizer_json: Path) -> int:
    """Ids a tokenizer.json can produce (its largest id + 1, added tokens included), read as
    plain JSON: the `tokenizers` package is not needed to check a config."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = (spec.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
    ids += [t["id"] for t in spec.get("added_tokens") or []]
    if not ids:
        raise ValueError(f"data.tokenizer_dir: {tokenizer_json} has no vocabulary: is it a tokenizer.json?")
    return max(ids) + 1
