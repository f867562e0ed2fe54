"""Llama-family logits equal Hugging Face transformers' (an independent implementation of the same
maths) within 1e-5 in fp32: tiny random LlamaForCausalLM (GQA, Llama 3 RoPE scaling with all
three frequency bands exercised, tied and untied head), Qwen2ForCausalLM (q, k, v biases, tied),
Qwen3ForCausalLM (QK-norm, head_dim != hidden / heads) and MistralForCausalLM, HF's weights
copied in through the name mapping, the model unsplit and cut into 2-4 stages run in sequence.

transformers is in the `test` extra only: pipetrain/ never imports it (test_architecture-style
check below)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetrain.config import LlamaModelConfig
from pipetrain.models.llama import Llama, hf_name, rope_inv_freq
from pipetrain.models.split import split_model

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")

pytestmark = pytest.mark.pure

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
# theta 100, head_dim 16: wavelengths 6.3 .. 353, so with original 64 / high 4 / low 1 some are
# kept (< 16), some smoothed (16..64) and some divided by the factor (> 64); T = 80 > 64.
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
CASES = {
    "llama-gqa-llama3-untied": ("LlamaForCausalLM", "LlamaConfig",
                                dict(SHAPE, rope_theta=100.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-llama3-tied": ("LlamaForCausalLM", "LlamaConfig",
                          dict(SHAPE, rope_theta=100.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2-qkv-bias-tied": ("Qwen2ForCausalLM", "Qwen2Config",
                            dict(SHAPE, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", "Qwen3Config",
                      dict(SHAPE, head_dim=24, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(SHAPE, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)),
}
BOUNDS = [  # 5 pipeline layers: embedding, 3 blocks, head
    [range(0, 5)],
    [range(0, 2), range(2, 5)],
    [range(0, 1), range(1, 4), range(4, 5)],
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)],
]
B, T = 2, 80


def hf_pair(case: str):
    """(HF model with every weight random, pipetrain model holding the same weights)."""
    model_cls, config_cls, kw = CASES[case]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"this transformers has no {model_cls}")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kw, attn_implementation="eager")
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: randomize all, so each one matters
        for name, p in hf.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * torch.randn_like(p))
    ours = Llama(**LlamaModelConfig.from_hf(config.to_dict()).knobs()).eval()
    hf_state = hf.state_dict()
    n = ours.config["num_hidden_layers"]
    mapped = {k: hf_state[hf_name(k, num_hidden_layers=n)] for k in ours.state_dict()}
    ours.load_state_dict(mapped, strict=True)
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_hf_unsplit_and_in_stages(case):
    hf, ours = hf_pair(case)
    idx = torch.randint(0, SHAPE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits  # (B, T, V)
        assert ref.abs().max() > 1.0  # weights large enough that a wrong op shows
        for bounds in BOUNDS:
            x = idx
            for stage in split_model(ours, bounds):
                x = stage(x)
            torch.testing.assert_close(x, ref, atol=1e-5, rtol=0, msg=f"{case} cut {[len(r) for r in bounds]}")
    tied = CASES[case][2]["tie_word_embeddings"]
    assert (ours.layers[-1].lm_head.weight is ours.layers[0].embed_tokens.weight) == tied


def test_llama3_scaling_is_exercised_in_all_three_bands():
    d = LLAMA3_ROPE
    plain, scaled = rope_inv_freq(16, 100.0, None), rope_inv_freq(16, 100.0, d)
    wavelen = 2 * torch.pi / plain
    kept = wavelen < d["original_max_position_embeddings"] / d["high_freq_factor"]
    divided = wavelen > d["original_max_position_embeddings"] / d["low_freq_factor"]
    smoothed = ~kept & ~divided
    assert kept.any() and divided.any() and smoothed.any()
    assert torch.equal(scaled[kept], plain[kept])
    torch.testing.assert_close(scaled[divided], plain[divided] / d["factor"])
    assert ((scaled[smoothed] < plain[smoothed]) & (scaled[smoothed] > plain[smoothed] / d["factor"])).all()


def test_pipetrain_never_imports_transformers():
    root = Path(__file__).resolve().parents[1] / "pipetrain"
    offenders = [p.name for p in root.rglob("*.py") if "transformers" in p.read_text()
                 and any(line.lstrip().startswith(("import transformers", "from transformers"))
                         for line in p.read_text().splitlines())]
    assert offenders == []
