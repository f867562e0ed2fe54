"""Chat data for the data=sft tests: a tiny Qwen-style tokenizer folder (a byte-level BPE trained here with
the `tokenizers` library, <|im_start|> / <|im_end|> / <|endoftext|> specials, a ChatML chat template in
tokenizer_config.json, EOS = <|im_end|> as Qwen's instruct models have it), optionally with a tiny Llama
saved by transformers beside it, and chat jsonl files of uneven lengths."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # the model's: the tokenizer's 256 bytes + merges + specials fit
# ChatML as Qwen2.5 writes it (a default system turn), without and with the {% generation %} marks
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ("the quick brown fox jumps over the lazy dog while a small bird sings about rivers, numbers 12 and 345, "
         "questions? answers! pipelines train models on many ranks and microbatches").split()


def chats(n: int, *, seed: int = 0) -> list[dict]:
    """`n` conversations of uneven length: some with a system turn, some with two exchanges, some as
    prompt / completion pairs."""
    import random

    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append({"prompt": text(rng.randint(2, 12)), "completion": text(rng.randint(1, 20))})
            continue
        msgs = ([{"role": "system", "content": text(4)}] if i % 3 == 0 else [])
        for _ in range(1 + i % 2):
            msgs += [{"role": "user", "content": text(rng.randint(2, 15))},
                     {"role": "assistant", "content": text(rng.randint(1, 25))}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_tokenizer(folder: Path, *, template: str = CHATML) -> Path:
    """tokenizer.json + tokenizer_config.json (chat_template, eos <|im_end|>, pad <|endoftext|>) in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["system user assistant helpful"]
    tok.train_from_iterator(lines * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": template, "model_max_length": 1024}))
    return folder


def chat_model(folder: Path, *, template: str = CHATML) -> Path:
    """A tiny Llama saved by transformers with the chat tokenizer beside it (a model.pretrained folder)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True))
    hf.save_pretrained(folder)
    return chat_tokenizer(folder, template=template)
