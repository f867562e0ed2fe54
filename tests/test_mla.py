"""Multi-head latent attention (models/mla.py) against transformers' DeepseekV3Attention and
DeepseekV2Attention built in the test with the same weights: with and without the query's low-rank
compression, with YaRN (its frequencies, its factor on cos/sin and the softmax's mscale) and without, RoPE
over interleaved pairs (DeepSeek's checkpoints) and half-split; within 1e-5. Also under document masks."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models.llama import Rotary
from pipetrain.models.mla import MLA, YarnRotary, softmax_scale, yarn_inv_freq

pytestmark = pytest.mark.pure

SHAPE = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12)
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


def hf_attention(kind: str, q_lora_rank, yarn, interleave: bool):
    """transformers' attention of `kind` (v3, v2), its rotary embedding and config, fp32, seeded weights."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0} if yarn is None else {**yarn, "rope_theta": 10000.0}
    common = dict(SHAPE, vocab_size=32, q_lora_rank=q_lora_rank, num_key_value_heads=4, intermediate_size=32,
                  max_position_embeddings=256, rope_parameters=rope, attn_implementation="eager")
    if kind == "v3":
        config = DeepseekV3Config(**common, rope_interleave=interleave)
        attn, rotary = DeepseekV3Attention(config, 0), DeepseekV3RotaryEmbedding(config)
    else:
        config = DeepseekV2Config(**common)
        attn, rotary = DeepseekV2Attention(config, 0), DeepseekV2RotaryEmbedding(config)
    torch.manual_seed(0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn.eval(), rotary


def ours(q_lora_rank, yarn, interleave: bool) -> MLA:
    s = SHAPE
    return MLA(hidden=s["hidden_size"], heads=s["num_attention_heads"], q_lora_rank=q_lora_rank,
               kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
               qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], attention_bias=False,
               rotary=YarnRotary(s["qk_rope_head_dim"], 10000.0, yarn), rope_interleave=interleave,
               scale=softmax_scale(s["qk_nope_head_dim"] + s["qk_rope_head_dim"], yarn))


def causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive


CASES = [("v3", 32, YARN, True), ("v3", None, YARN, True), ("v3", 32, None, True), ("v3", 32, YARN, False),
         ("v2", None, YARN, True), ("v2", 32, None, True)]


@pytest.mark.parametrize("kind, q_lora_rank, yarn, interleave", CASES)
def test_mla_equals_transformers(kind, q_lora_rank, yarn, interleave):
    ref, rotary = hf_attention(kind, q_lora_rank, yarn, interleave)
    mine = ours(q_lora_rank, yarn, interleave)
    assert sorted(n for n, _ in mine.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    mine.load_state_dict(ref.state_dict())
    assert mine.scale == ref.scaling
    t = 48  # past the original context of 32: YaRN's interpolated frequencies matter
    x = torch.randn(2, t, SHAPE["hidden_size"])
    with torch.no_grad():
        want, _ = ref(x, position_embeddings=rotary(x, torch.arange(t)[None]), attention_mask=causal(t))
        got = mine(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_yarn_frequencies_and_factor_are_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for yarn in (YARN, {**YARN, "mscale": 1.0, "mscale_all_dim": 0.0}, {**YARN, "beta_fast": 4.0, "factor": 40.0}):
        config = DeepseekV3Config(**SHAPE, rope_parameters={**yarn, "rope_theta": 10000.0})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        got, got_factor = yarn_inv_freq(SHAPE["qk_rope_head_dim"], 10000.0, yarn)
        assert torch.equal(got, inv) and got_factor == pytest.approx(factor, rel=1e-15)


def test_mla_within_documents_equals_each_document_alone():
    """A packed row of two documents with a block-causal mask and RoPE restarting per document: each
    document's outputs equal the document run alone."""
    from pipetrain.runtime.documents import Documents

    mine = ours(32, YARN, True)
    for p in mine.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 12, SHAPE["hidden_size"])
    index = torch.tensor([[0] * 5 + [1] * 7])
    docs = Documents(index, torch.tensor([list(range(5)) + list(range(7))]))
    with torch.no_grad():
        packed = mine(x, docs)
        alone = torch.cat([mine(x[:, :5]), mine(x[:, 5:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_plain_rope_is_llamas():
    assert torch.equal(YarnRotary(8, 10000.0, None).inv_freq, Rotary(8, 10000.0, None).inv_freq)
