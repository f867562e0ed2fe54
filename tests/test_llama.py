"""The Llama family as pipeline layers: preset sizes to the parameter (built on meta), HF names by
an index shift, the cost model against what autograd keeps, seeded meta materialization with a
tied head, and llama-tiny under every schedule in mode=simulate."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from pipetrain.config import LLAMA_OPTIONS, LlamaModelConfig
from pipetrain.models.llama import Llama, hf_name, pipetrain_name
from pipetrain.models.llama_costs import llama_layer_params, llama_param_count
from pipetrain.models.split import build_stage
from pipetrain.plan import build_model
from pipetrain.schedules import registry
from pipetrain.simulate_cmd import plan_and_simulate

pytestmark = pytest.mark.pure

# The published sizes (a tied embedding counted once: the checkpoints store it once).
EXACT = {
    "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496, "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920, "mistral-7b-v0.3": 7_248_023_552, "llama-tiny": 1_640_576,
    "llama3.1-405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B: 126 layers of 16384, ffn 53248
}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_scaling=None)


def meta_preset(compose, name: str) -> Llama:
    return build_model(compose([f"model={name}"]).model, device="meta")


@pytest.mark.parametrize("name", list(EXACT))
def test_presets_meet_the_published_parameter_counts(compose, name):
    model = meta_preset(compose, name)  # shapes only: 70B costs no memory
    tied = model.config["tie_word_embeddings"]
    assert sum(p.numel() for p in model.parameters()) == llama_param_count(model.config) == EXACT[name]
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]  # the head counts its tie
    assert per_layer == llama_layer_params(model.config)
    costs = model.cost_model(microbatch=1, seq=16, tflops=1.0)
    assert [c.params for c in costs] == per_layer
    # the pipeline counts a tied copy where it is stored: the head's stage holds V x C too
    v, c = model.config["vocab_size"], model.config["hidden_size"]
    assert sum(c.params for c in costs) == EXACT[name] + (v * c if tied else 0)


def test_hf_names_are_an_index_shift(compose):
    for name in ("llama3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b"):
        model = meta_preset(compose, name)
        n = model.config["num_hidden_layers"]
        for ours, _ in model.named_parameters(remove_duplicate=False):
            key = hf_name(ours, num_hidden_layers=n)
            assert pipetrain_name(key, num_hidden_layers=n) == ours
    n = 16
    assert hf_name("layers.0.embed_tokens.weight", num_hidden_layers=n) == "model.embed_tokens.weight"
    assert hf_name("layers.1.self_attn.q_proj.weight", num_hidden_layers=n) == "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("layers.16.mlp.down_proj.weight", num_hidden_layers=n) == "model.layers.15.mlp.down_proj.weight"
    assert hf_name("layers.17.norm.weight", num_hidden_layers=n) == "model.norm.weight"
    assert hf_name("layers.17.lm_head.weight", num_hidden_layers=n) == "lm_head.weight"
    for bad in ("layers.18.norm.weight", "model.layers.0.x", "embed.weight"):
        with pytest.raises(ValueError, match="not a parameter"):
            hf_name(bad, num_hidden_layers=n)
    for bad in ("model.layers.16.mlp.up_proj.weight", "model.rotary_emb.inv_freq", "transformer.wte.weight"):
        with pytest.raises(ValueError, match="not a key") as info:
            pipetrain_name(bad, num_hidden_layers=n)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cost_model_activations_are_what_autograd_keeps(qk_norm):
    """Bytes autograd saves per token in embedding, block and head (+ loss), weights not counted,
    within the small per-token terms the model leaves out (rsqrt and log-sum-exp values, RoPE tables)."""
    assert_costs_keep_what_autograd_saves(Llama(**TINY, head_dim=16, qk_norm=qk_norm))  # head_dim 16 != 32 / 4


def assert_costs_keep_what_autograd_saves(model, layers=(0, 1, 3), b: int = 2, t: int = 8) -> None:
    """Each of `layers` of a 2-block model (vocabulary 64, width 32): the cost model's activation bytes per token
    within 10% below what autograd saves, weights not counted (the head with its loss)."""
    costs = model.cost_model(microbatch=b, seq=t, tflops=1.0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for i in layers:
        seen: set[int] = set()

        def pack(tensor, seen: set = seen):  # this layer's set, bound now
            if tensor.untyped_storage().data_ptr() not in weights:
                seen.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
            return tensor

        x = torch.randint(0, 64, (b, t)) if i == 0 else torch.randn(b, t, 32, requires_grad=True)  # a stage input
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.layers[i](x)
            if i == len(model.layers) - 1:
                model.loss(out, torch.zeros(b, t, dtype=torch.long))
        measured = sum(n for _, n in seen) / (b * t)
        assert costs[i].activation_bytes_per_token <= measured <= 1.1 * costs[i].activation_bytes_per_token, i


def test_flops_are_six_n_plus_attention():
    model = Llama(**TINY)
    t, cfg = 16, model.config
    costs = model.cost_model(microbatch=1, seq=t, tflops=1.0)
    n_matmul = llama_param_count(cfg) - cfg["vocab_size"] * cfg["hidden_size"] * (not cfg["tie_word_embeddings"])
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    assert 3 * sum(c.flops_per_token for c in costs) == 6 * n_matmul + 12 * cfg["num_hidden_layers"] * q * t


def test_meta_stages_with_a_tied_head_equal_the_model_built_for_real():
    real = Llama(**TINY, tie_word_embeddings=True, seed=3)
    with torch.device("meta"):
        meta = Llama(**TINY, tie_word_embeddings=True)
    ref = dict(real.named_parameters(remove_duplicate=False))
    head = build_stage(meta, range(3, 4), stage_id=1, seed=3)  # the head alone: its copy of the embedding
    first = build_stage(meta, range(0, 3), stage_id=0, seed=3)
    for stage in (first, head):
        for name, p in stage.named_parameters(remove_duplicate=False):
            assert torch.equal(p, ref[name]), name
    assert head.tied == {"layers.3.lm_head.weight": "layers.0.embed_tokens.weight"}
    idx, _ = real.example_batch(microbatch=2, seq=8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the RoPE tables of a meta-built model are real too
        assert torch.equal(head(first(idx)), real(idx))
    assert (real.layers[1].mlp.down_proj.weight.std() - 0.01).abs() < 0.002  # 0.02 / sqrt(2 L), L = 2
    assert torch.equal(real.layers[3].norm.weight, torch.ones(32))


def test_layers_are_named_as_hf_blocks_and_bounded_by_max_positions():
    model = Llama(**TINY)
    assert model.layer_names == ["embed", "layers.0", "layers.1", "head"]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.boundary_specs(microbatch=1, seq=65)


@pytest.mark.parametrize("knobs, words", [
    (dict(num_key_value_heads=3), ["model.num_attention_heads=4", "model.num_key_value_heads=3"]),
    (dict(hidden_size=30), ["model.hidden_size=30", "model.num_attention_heads", "model.head_dim"]),
    (dict(head_dim=15), ["model.head_dim=15", "even"]),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), ["model.rope_scaling.rope_type=yarn", "null"]),
    (dict(rope_scaling=dict(low_freq_factor=4.0, high_freq_factor=1.0)), ["low_freq_factor < high_freq_factor"]),
    (dict(attention_bias=True, qkv_bias=True), ["model.qkv_bias"]),
    (dict(num_hidden_layers=0), ["model.num_hidden_layers"]),
])
def test_bad_knobs_fail_in_one_line_naming_them(knobs, words):
    with pytest.raises(ValueError) as info:
        Llama(**{**TINY, **knobs})
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_from_hf_reads_both_config_forms():
    classic = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192), hidden_act="silu", mlp_bias=False)
    v5 = {k: v for k, v in classic.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(classic["rope_scaling"], rope_theta=500000.0)
    preset = LlamaModelConfig(name="llama3.2-1b", head_dim=64)
    for hf in (classic, v5):
        assert LlamaModelConfig.from_hf(hf, name="llama3.2-1b") == preset
    qwen2 = LlamaModelConfig.from_hf(dict(v5, model_type="qwen2", rope_parameters=dict(rope_type="default",
                                                                                      rope_theta=1e6)))
    assert qwen2.qkv_bias and not qwen2.attention_bias and qwen2.rope_scaling is None and qwen2.rope_theta == 1e6
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        LlamaModelConfig.from_hf(dict(classic, model_type="gpt2"))
    with pytest.raises(ValueError, match="sliding_window=4096"):
        LlamaModelConfig.from_hf(dict(classic, model_type="mistral", sliding_window=4096))


@pytest.mark.parametrize("schedule", registry.names())
def test_llama_tiny_simulates_under_every_schedule(compose, schedule):
    extra = ["schedule.virtual_stages=2"] if schedule in ("interleaved_1f1b", "looped_bfs") else []
    config = compose(["model=llama-tiny", f"schedule={schedule}", "mode=simulate", "pipeline.degree=4",
                      "pipeline.microbatches=16", "data.batch_size=16", *extra])
    plan, record = plan_and_simulate(config, None, Console(file=io.StringIO()), timeline=False, write=False)
    assert plan.partition.layer_names(0)[0] == "embed" and plan.partition.layer_names(-1)[-1] == "head"
    assert 0 <= record["bubble_fraction_mean"] < 1 and plan.cost_source == "analytic"


def test_presets_are_the_documented_options(compose):
    for name in LLAMA_OPTIONS:
        cfg = compose([f"model={name}"]).model
        assert type(cfg) is LlamaModelConfig and cfg.name == name and name in EXACT


def test_bf16_pipeline_matches_fp32_within_bf16_rounding(compose):
    """trainer.precision=bf16 on one rank holding two stages (interleaved 1F1B at P=1, v=2): the
    RoPE tables follow q's dtype, RMSNorm computes in fp32, bf16 crosses the cut."""
    from pipetrain.train.pipeline import build_rank_pipeline

    model = build_model(compose(["model=llama-tiny"]).model, device="meta")
    sched = registry.build("interleaved_1f1b", 1, 4, 2)
    g = torch.Generator().manual_seed(0)
    batch = [model.example_batch(microbatch=2, seq=16, generator=g) for _ in range(4)]
    losses = {}
    for precision in ("fp32", "bf16"):
        rp = build_rank_pipeline(model, [range(0, 5), range(5, 10)], sched, 0, microbatch_size=2, seq_len=16,
                                 precision=precision, seed=0)
        losses[precision] = rp.train_step(batch).loss
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=1e-2)
