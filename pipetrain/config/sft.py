"""data=sft: chat data for supervised fine-tuning, checked before any process starts (pure Python).

A sample is a row of a `datasets` source (the same files, folders and mixtures as data=datasets) holding
either `messages`, a list of {role, content} (role one of ROLES), or `prompt` and `completion`: strings
(a user turn and the assistant's answer) or lists of messages (the conversational form TRL reads).
It is rendered with the chat template of the tokenizer's folder (tokenizer_config.json's `chat_template`,
or chat_template.jinja as newer transformers save it) exactly as transformers' `apply_chat_template`
renders it (train/chat.py), and the loss is on the assistant's tokens (data.loss_on=assistant) or on
every token of the sample (all). Rendering and packing: train/hf_sft.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol


class DataConfig(Protocol):
    """What this file reads of config/data.py's DataConfig (which imports this file: no import back)."""

    name: str
    loss_on: str
    truncate: bool
    add_bos: bool
    streaming: Optional[bool]
    tokenizer: Optional[str]
    tokenizer_dir: Optional[str]

    @property
    def tokenizer_name(self) -> str: ...

LOSS_ON = ("assistant", "all")
# the roles chat templates know (OpenAI's, with Llama 3.1's ipython for tool output)
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the special tokens transformers hands a template as variables (SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def check_sft_knobs(cfg: DataConfig) -> None:
    """data.loss_on and data.truncate are data=sft's; knobs of data=datasets that make no sense for chats."""
    if cfg.name != "sft":
        for knob, default in (("loss_on", "assistant"), ("truncate", True)):
            if getattr(cfg, knob) != default:
                raise ValueError(f"data.{knob} is only read by data=sft (got data={cfg.name}): set data=sft or "
                                 f"drop data.{knob}")
        return
    if cfg.loss_on not in LOSS_ON:
        raise ValueError(f"data.loss_on={cfg.loss_on!r} is unknown: choose assistant (the assistant's tokens) or all")
    if cfg.add_bos:
        raise ValueError("data.add_bos=true with data=sft: the chat template writes BOS where the model expects one; "
                         "drop data.add_bos")
    if cfg.streaming:
        raise ValueError("data.streaming=true is not supported with data=sft yet (chats are rendered and cached "
                         "once): set data.streaming=false")


def check_sft_tokenizer(cfg: DataConfig) -> None:
    """data=sft renders chats with the tokenizer folder's chat template: an hf tokenizer whose folder has one."""
    if cfg.name != "sft":
        return
    if cfg.tokenizer != "hf":
        raise ValueError(f"data=sft renders chats with a Hugging Face tokenizer's chat template, not "
                         f"data.tokenizer={cfg.tokenizer_name}: set model.pretrained=DIR (a model folder with "
                         "tokenizer.json and a chat template) or data.tokenizer=hf data.tokenizer_dir=DIR")
    chat_template(cfg.tokenizer_dir or "")


def chat_template(folder: str) -> str:
    """The chat template of a tokenizer folder: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template} whose `default` is taken)."""
    path = Path(folder).expanduser()
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"data.tokenizer_dir={folder} has no chat template (no {CHAT_TEMPLATE_FILE}, no "
                         "chat_template in tokenizer_config.json): add one there (an instruct model's folder has "
                         "it), or train on plain text with data=datasets")
    return template


def tokenizer_config(folder: str) -> dict[str, Any]:
    path = Path(folder).expanduser() / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def special_tokens(folder: str) -> dict[str, str]:
    """The special tokens transformers passes a chat template (`bos_token`, `eos_token`, ...): those
    tokenizer_config.json (then special_tokens_map.json) names, as strings."""
    out: dict[str, str] = {}
    extra = Path(folder).expanduser() / "special_tokens_map.json"
    for spec in (tokenizer_config(folder), json.loads(extra.read_text(encoding="utf-8")) if extra.is_file() else {}):
        for key in SPECIAL_TOKENS:
            value = spec.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and key not in out:
                out[key] = value
    return out


def chat_messages(row: dict[str, Any], *, where: str) -> list[dict[str, Any]]:
    """A sample's messages: row["messages"], or row["prompt"] + row["completion"]; one line naming
    `where` (the file and row) for a missing field, a message that is no {role, content}, an unknown role."""
    if row.get("messages") is not None:
        messages = row["messages"]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        messages = [*(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]),
                    *(completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])]
    else:
        raise ValueError(f"{where} has no 'messages' and no 'prompt' + 'completion' (fields: {', '.join(row)}): "
                         "give each sample messages=[{role, content}, ...] or a prompt and a completion")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} (got {messages!r:.80})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where} message {i} is not {{role, content}} (got {m!r:.80})")
        if m["role"] not in ROLES:
            raise ValueError(f"{where} message {i} has an unknown role {m['role']!r}: use one of {', '.join(ROLES)}")
        # transformers drops the keys whose value is None (a datasets row holds every column's key)
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def check_chat_row(ds: Any, *, spec: str, split: str) -> None:
    """The first row of a chat source is a sample (chat_messages); an empty split is one line too."""
    first: Optional[dict[str, Any]] = next(iter(ds), None) if not hasattr(ds, "__len__") or len(ds) else None
    if first is None:
        raise ValueError(f"data.path={spec} split {split!r} is empty (no rows): give a source with chats")
    chat_messages(first, where=f"data.path={spec} row 0 of split {split!r}")
