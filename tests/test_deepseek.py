"""The DeepSeek family as pipeline layers: presets built on meta with transformers' parameter counts,
the cost model against what autograd keeps and the 6N FLOP rule, DeepSeek-V2's group-limited routing
against transformers' router, and bad tensor-parallel degrees refused in one line before any rank."""

from __future__ import annotations

import pytest
import torch
from test_llama import assert_costs_keep_what_autograd_saves

from pipetrain.config import DEEPSEEK_OPTIONS
from pipetrain.models.deepseek import DeepSeek
from pipetrain.models.deepseek_costs import deepseek_param_count, mla_attention
from pipetrain.plan import build_model

pytestmark = pytest.mark.pure

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            max_position_embeddings=64, moe=None)


def transformers_count(m) -> int:
    """transformers' DeepseekV3ForCausalLM (DeepseekV2ForCausalLM for V2-Lite) built on meta from the same values."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    moe = m.moe
    hf = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
              moe_intermediate_size=moe.intermediate_size, num_hidden_layers=m.num_hidden_layers,
              num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
              n_shared_experts=moe.num_shared_experts, n_routed_experts=moe.num_experts, kv_lora_rank=m.kv_lora_rank,
              q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
              qk_nope_head_dim=m.qk_nope_head_dim, num_experts_per_tok=moe.top_k,
              first_k_dense_replace=moe.first_dense_layers, tie_word_embeddings=m.tie_word_embeddings,
              n_group=moe.n_group, topk_group=moe.topk_group)
    v2 = m.name == "deepseek-v2-lite"
    config, model = (DeepseekV2Config, DeepseekV2ForCausalLM) if v2 else (DeepseekV3Config, DeepseekV3ForCausalLM)
    with torch.device("meta"):
        total = sum(p.numel() for p in model(config(**hf)).parameters())
        if not m.mtp.depth:
            return total
        # the MTP module (transformers leaves it out): per depth a decoder block like the last, enorm, hnorm,
        # shared_head.norm and eh_proj (2C -> C); its embedding and head are the main model's
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        block = DeepseekV3DecoderLayer(config(**hf), layer_idx=m.num_hidden_layers - 1)
        c = m.hidden_size
        return total + m.mtp.depth * (sum(p.numel() for p in block.parameters()) + 3 * c + 2 * c * c)


# The published totals (the presets' yaml say where from); deepseek-v3's is a default DeepseekV3Config's
# 671,026,404,352 and its MTP module's own 11,610,067,968 (with the release's stored copies of the embedding and
# head, 2 x 926,679,040 more: 684,489,830,400, the published "685B").
EXACT = {"deepseek-v3": 682_636_472_320, "deepseek-v2-lite": 15_706_484_224, "moonlight-16b-a3b": 15_960_108_544,
         "kimi-k2": 1_026_408_209_408, "deepseek-tiny": 2_041_728}


@pytest.mark.parametrize("name", DEEPSEEK_OPTIONS)
def test_presets_equal_transformers_on_meta(compose, name):
    m = compose([f"model={name}"]).model
    model = build_model(m, device="meta")
    # the router's aux-free bias is state the balance rule moves, not a weight (HF: a buffer)
    ours = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("expert_bias"))
    assert ours == deepseek_param_count(model.config) == transformers_count(m) == EXACT[name]
    costs = model.cost_model(microbatch=1, seq=16, tflops=1.0)
    per_layer = [sum(p.numel() for n, p in layer.named_parameters() if not n.endswith("expert_bias"))
                 for layer in model.layers]
    assert [c.params for c in costs] == per_layer


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_cost_model_activations_are_what_autograd_keeps(q_lora_rank):
    """Bytes autograd saves per token in embedding, an MLA block and head (+ loss), weights not counted,
    within the small per-token terms the model leaves out (rsqrt and log-sum-exp values, RoPE tables)."""
    assert_costs_keep_what_autograd_saves(DeepSeek(**{**TINY, "q_lora_rank": q_lora_rank}))


def test_flops_are_six_n_plus_attention():
    model = DeepSeek(**TINY)
    t, cfg = 16, model.config
    costs = model.cost_model(microbatch=1, seq=t, tflops=1.0)
    n_matmul = deepseek_param_count(cfg) - cfg["vocab_size"] * cfg["hidden_size"]  # the embedding is a lookup
    h, d_qk, d_v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    attention = 6 * cfg["num_hidden_layers"] * t * h * (d_qk + d_v)  # QK^T and AV: forward 2 T H (d_qk + d_v)
    assert 3 * sum(c.flops_per_token for c in costs) == 6 * n_matmul + attention
    assert {c.kv_values_per_token for c in costs[1:-1]} == {mla_attention(cfg, seq=t).kv_values} == {h * (d_qk + d_v)}


def test_v2_group_limited_routing_equals_transformers():
    """group_score=max is DeepSeek-V2's group_limited_greedy: a group scored by its best softmax score."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from pipetrain.config.moe import MoEConfig
    from pipetrain.models.moe_router import Router

    hf = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                                               num_experts_per_tok=3, n_group=4, topk_group=2,
                                               topk_method="group_limited_greedy", routed_scaling_factor=1.5))
    torch.nn.init.normal_(hf.weight, generator=torch.Generator().manual_seed(1))
    mine = Router(MoEConfig(num_experts=16, top_k=3, score_func="softmax", norm_topk_prob=False, n_group=4,
                            topk_group=2, group_score="max", routed_scaling_factor=1.5), hidden=32)
    mine.weight.data.copy_(hf.weight)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    _, weights, ids = hf(x)
    got = mine(x)
    order, got_order = ids.sort(-1).indices, got.ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), got.ids.gather(1, got_order))
    torch.testing.assert_close(got.gates.gather(1, got_order), weights.gather(1, order), rtol=0, atol=1e-6)
    top2 = Router(MoEConfig(**{**vars(mine.config), "group_score": "top2"}), hidden=32)
    top2.weight.data.copy_(hf.weight)
    assert not torch.equal(top2(x).ids.sort(-1).values, got.ids.sort(-1).values)  # the formulas differ here


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=2", "model.moe.intermediate_size=63"],  # each expert split in its width, as the dense MLP
     "parallel.tp=2 must divide model.moe.intermediate_size=63: set parallel.tp to a divisor of 63"),
    (["parallel.tp=8", "model.moe=null", "data.seq_len=16"],
     "parallel.tp=8 must divide model.num_attention_heads=4: set parallel.tp to a divisor of 4"),
])
def test_bad_tensor_parallel_degrees_are_refused_in_one_line(compose, overrides, message):
    with pytest.raises(Exception) as info:
        compose(["model=deepseek-tiny", "pipeline.degree=1", *overrides])
    err = info.value
    while err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, ValueError) and "\n" not in str(err)
    assert __import__("re").search(message, str(err)), str(err)


def test_deepseek_tiny_simulates_under_dualpipev(compose):
    from pipetrain.plan import make_plan

    plan = make_plan(compose(["model=deepseek-tiny", "mode=simulate", "schedule=dualpipev", "pipeline.degree=2",
                              "data.seq_len=32"]))
    assert plan.partition.num_chunks == 4


def test_the_mtp_blocks_experts_split_over_expert_parallel_as_every_moe_blocks():
    """The MTP depth's MoE block declares its stacked experts (WithMTP.ep_plan): an ep rank keeps its
    4 of 8 rows of them, recorded by global index as the main blocks' experts."""
    from pipetrain.models.split import cut_stage
    from pipetrain.parallel.ep import parallelize_experts
    from pipetrain.runtime.ep_comm import EPGroup

    with torch.device("meta"):
        model = DeepSeek(**{**TINY, "num_hidden_layers": 2, "mtp": {"depth": 1},
                            "moe": dict(num_experts=8, top_k=2, intermediate_size=8, first_dense_layers=1)})
    last = len(model.layers) - 1
    stage = parallelize_experts(cut_stage(model, range(last - 1, last + 1), stage_id=1), EPGroup(None, 2, 1))
    mtp = f"layers.{last}.mtp.0.block.mlp.experts"
    main = f"layers.{last - 1}.mlp.experts"
    for path in (main, mtp):
        weights = dict(stage.get_submodule(path).named_parameters())
        assert weights and all(w.shape[0] == 4 for w in weights.values())
        assert {f"{path}.{n}" for n in weights} <= set(stage.ep_shards)
