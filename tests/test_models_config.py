"""Model, data and partition configs: every option composes, the plan cuts real models by the
configured strategy, the table and the simulation read the same costs, bad input names the knob."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import assert_torch_free
from pipetrain.compose import CONF_DIR
from pipetrain.config import (
    DEEPSEEK_OPTIONS, LLAMA_OPTIONS, MODEL_OPTIONS, MOE_OPTIONS, PARTITIONS, Config, DataConfig, GPT2ModelConfig,
    LlamaModelConfig, MLPModelConfig, SleepModelConfig,
)
from pipetrain.config.deepseek import DeepSeekModelConfig
from pipetrain.plan import make_plan
from pipetrain.schedules.simulate import StageCosts

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
MODEL_FILES = sorted(p.stem for p in (Path(CONF_DIR) / "model").glob("*.yaml"))
PARTITION_FILES = sorted(p.stem for p in (Path(CONF_DIR) / "partition").glob("*.yaml"))
GPT2_OPTIONS = [m for m in MODEL_OPTIONS if m.startswith("gpt2")]
SCHEMA = {"sleep": SleepModelConfig, "mlp": MLPModelConfig, **{m: GPT2ModelConfig for m in GPT2_OPTIONS},
          **{m: LlamaModelConfig for m in (*LLAMA_OPTIONS, *MOE_OPTIONS)},
          **{m: DeepSeekModelConfig for m in DEEPSEEK_OPTIONS}}


def root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:  # OmegaConf wraps errors raised in __post_init__
        err = err.__cause__
    return err


def test_config_files_are_the_documented_options():
    assert MODEL_FILES == sorted(MODEL_OPTIONS)
    assert PARTITION_FILES == sorted(PARTITIONS)


@pytest.mark.parametrize("name", MODEL_OPTIONS)
def test_every_model_option_composes_typed(compose, name):
    cfg = compose([f"model={name}"])
    assert type(cfg.model) is SCHEMA[name] and cfg.model.name == name


@pytest.mark.parametrize("name", GPT2_OPTIONS)
def test_gpt2_files_carry_the_presets(compose, name):
    from pipetrain.models.gpt2 import PRESETS

    knobs = compose([f"model={name}"]).model.knobs()
    assert {k: knobs[k] for k in PRESETS[name]} == PRESETS[name]
    assert knobs["dropout"] == 0.0 and knobs["bias"] is True


def test_schema_defaults_are_gpt2_124m():
    from pipetrain.models.gpt2 import PRESETS

    knobs = GPT2ModelConfig().knobs()
    assert {k: knobs[k] for k in PRESETS["gpt2"]} == PRESETS["gpt2"]


def _valid_overrides(model: str, part: str) -> list[str]:
    out = [f"model={model}", f"partition={part}", "pipeline.degree=4"]
    if model == "sleep":
        out.append("model.layers=8")  # 8 layers: the boundaries below fit every model
    if model == "mlp":
        out.append("model.n_layer=8")
    if part == "manual":
        out.append("partition.boundaries=[2,4,6]")
    return out


@pytest.mark.parametrize("part", PARTITIONS)
@pytest.mark.parametrize("model", MODEL_OPTIONS)
def test_every_model_and_partition_compose(compose, model, part):
    cfg = compose(_valid_overrides(model, part))
    assert cfg.partition.name == part and cfg.model.name == model
    if part == "manual":
        assert cfg.partition.boundaries == [2, 4, 6]


@pytest.mark.parametrize("part", [p for p in PARTITIONS if p != "profile"])
@pytest.mark.parametrize("model", ["mlp", "gpt2-tiny", "gpt2", "llama-tiny", "llama3.1-8b"])
def test_every_model_and_partition_plan(compose, model, part):
    plan = make_plan(compose(_valid_overrides(model, part)))
    assert plan.partition.num_chunks == 4 and plan.partition.strategy == part
    assert plan.cost_source == "analytic"


@pytest.mark.parametrize("part", ["uniform", "params", "balanced", "manual"])
def test_sleep_plans(compose, part):
    plan = make_plan(compose(_valid_overrides("sleep", part)))
    assert [len(r) for r in plan.chunk_bounds] == [2, 2, 2, 2]  # equal layers: every strategy is uniform
    assert plan.cost_source == "sleep"


def test_sleep_has_no_flops_to_balance(compose):
    with pytest.raises(ValueError, match="partition=balanced or partition=uniform"):
        make_plan(compose(_valid_overrides("sleep", "flops")))


def test_table_and_simulation_read_the_same_costs(compose):
    cfg = compose(["model=gpt2", "partition=balanced", "pipeline.degree=4", "schedule=zbv"])
    plan = make_plan(cfg)
    assert plan.stage_costs == StageCosts.from_chunks(plan.schedule, plan.partition.chunk_fbw())
    per_stage = [plan.stage_costs.f[s] + plan.stage_costs.b[s] + plan.stage_costs.w[s] for s in range(8)]
    assert per_stage == pytest.approx(plan.partition.chunk_time_ms(), rel=1e-12)
    # the embedding opens the first stage, the head closes the last
    assert plan.partition.layer_names(0)[0] == "embed" and plan.partition.layer_names(7)[-1] == "head"


def test_balanced_beats_uniform_on_gpt2(compose):
    base = ["model=gpt2", "pipeline.degree=4", "data.seq_len=1024"]
    uniform = make_plan(compose([*base, "partition=uniform"])).partition
    balanced = make_plan(compose([*base, "partition=balanced"])).partition
    assert max(balanced.chunk_time_ms()) < max(uniform.chunk_time_ms())


def test_costs_follow_microbatch_seq_and_tflops(compose):
    def head_ms(*over):
        return make_plan(compose(["model=gpt2", *over])).layer_costs[-1].f_ms

    base = head_ms()  # batch 16 / 8 microbatches = 2 sequences of 64 tokens per microbatch
    assert head_ms("data.batch_size=32") == pytest.approx(2 * base)
    assert head_ms("data.seq_len=128") == pytest.approx(2 * base)
    # data parallel: each pipeline's microbatch is 1/dp of it
    assert head_ms("data.batch_size=32", "parallel.dp_replicate=2") == pytest.approx(base)
    assert head_ms("sim.tflops=200") == pytest.approx(base / 2)


@pytest.mark.parametrize("model", [m for m in MODEL_OPTIONS if m in ("sleep", "mlp", "gpt2-tiny", "llama-tiny",
                                                                     "moe-tiny", "deepseek-tiny", "qwen3-0.6b")])
def test_a_config_costs_its_layers_as_its_built_model(compose, model):
    """The launcher costs a model from its config alone (models/costs.py, no torch): the same LayerCosts the
    model built from that config answers (its resolved knobs are the built model's `config`)."""
    from pipetrain.models.costs import config_layer_costs
    from pipetrain.plan import build_model

    m = compose([f"model={model}"]).model
    seq = 32 if m.has_seq else 1
    built = build_model(m, device="meta")
    assert built.config == m.resolved_knobs()
    assert config_layer_costs(m, microbatch=2, seq=seq, tflops=3.0) == built.cost_model(microbatch=2, seq=seq,
                                                                                         tflops=3.0)


@pytest.mark.parametrize("model", MODEL_OPTIONS)
def test_what_the_planner_reads_of_a_model_is_what_its_built_model_measures(compose, model):
    """mode=plan reads a model's loss bytes, autocast's weight copies and tied weights from its config
    (models/costs.py, no torch): the values models/profile.py measures on the model built on meta."""
    from pipetrain.models.costs import autocast_copy_bytes, loss_bytes_per_token, tied_layers
    from pipetrain.models.profile import autocast_weight_bytes, loss_saved_bytes_per_token, tied_weights
    from pipetrain.plan import costing_model

    m = compose([f"model={model}"]).model
    built = costing_model(m)
    if built is None:  # model=sleep: the planner reads none of them
        assert tied_layers(m) == () and loss_bytes_per_token(m, seq=1) == 0.0
        return
    for precision in ("fp32", "bf16"):
        assert autocast_copy_bytes(m, precision=precision) == autocast_weight_bytes(built, precision=precision)
    for seq in ((4, 64) if m.has_seq else (1,)):
        assert loss_bytes_per_token(m, seq=seq) == loss_saved_bytes_per_token(built, seq=seq, precision="bf16") \
            == loss_saved_bytes_per_token(built, seq=seq, precision="fp32")
    assert tied_layers(m) == tied_weights(built)


def test_the_plan_of_a_run_costs_its_layers_without_torch():
    """make_plan (mode=simulate, and the launcher before it starts ranks) for GPT-2, Llama, MoE and DeepSeek."""
    assert_torch_free("""
from pipetrain.compose import compose_config
from pipetrain.plan import make_plan
for model in ("gpt2-tiny", "llama-tiny", "moe-tiny", "deepseek-tiny", "mlp"):
    make_plan(compose_config([f"model={model}", "pipeline.degree=2"]))
""")


def test_gpt2_xl_costs_take_no_memory(compose):
    t0 = time.perf_counter()
    plan = make_plan(compose(["model=gpt2-xl", "partition=balanced", "pipeline.degree=8"]))
    assert time.perf_counter() - t0 < 10  # meta device: no 6 GB of fp32 weights to initialise
    assert sum(plan.partition.chunk_params()) == 1_557_611_200 + 50257 * 1600  # head counts its tied copy


def test_profile_measures_and_balances_time(compose, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_CACHE_DIR", str(tmp_path))
    cfg = compose(["model=gpt2-tiny", "partition=profile", "pipeline.degree=2", "data.seq_len=32"])
    plan = make_plan(cfg)
    assert plan.partition.strategy == "profile" and plan.partition.balanced_on == "time"
    assert plan.cost_source.startswith("measured:")
    assert all(c.f_ms > 0 for c in plan.layer_costs)
    (cached,) = (tmp_path / "profile").glob("*.json")
    assert json.loads(cached.read_text())["key"]["seq"] == 32
    assert make_plan(cfg).layer_costs == plan.layer_costs  # the second run reads the cache


def test_sleep_plan_never_imports_torch():
    assert_torch_free(
        "from pipetrain.config import Config, PartitionConfig, SleepModelConfig\n"
        "from pipetrain.plan import make_plan\n"
        "for name in ('uniform', 'params', 'balanced'):\n"
        "    make_plan(Config(model=SleepModelConfig(), partition=PartitionConfig(name)))\n"
        "make_plan(Config(model=SleepModelConfig(), partition=PartitionConfig('manual', [3])))\n"
    )


@pytest.mark.parametrize(
    "overrides, knobs",
    [
        (["model=gpt2", "model.n_head=5"], ["model.n_embd", "model.n_head"]),
        (["model=gpt2", "model.dropout=1.0"], ["model.dropout"]),
        (["model=mlp", "model.d_hidden=0"], ["model.d_hidden"]),
        (["model=gpt2", "data.batch_size=12"], ["data.batch_size", "pipeline.microbatches"]),
        (["model=gpt2-tiny", "data.seq_len=512"], ["data.seq_len", "model.block_size"]),
        (["data.seq_len=0"], ["data.seq_len"]),
        (["data.name=text"], ["data="]),
        (["model=gpt2-tiny", "schedule=zbv", "pipeline.degree=8", "pipeline.microbatches=16"],
         ["pipeline.degree", "model.n_layer"]),
        (["model=mlp", "schedule=interleaved_1f1b", "schedule.virtual_stages=3", "pipeline.microbatches=4"],
         ["pipeline.degree", "schedule.virtual_stages"]),
        (["partition=manual"], ["partition.boundaries"]),
        (["partition=manual", "partition.boundaries=[8,4]"], ["partition.boundaries"]),
        (["partition=manual", "partition.boundaries=[4,8]"], ["partition.boundaries"]),  # 2 stages need 1
        (["partition=balanced", "partition.boundaries=[8]"], ["partition=manual"]),
        (["partition.name=greedy"], ["partition=", "balanced"]),
        (["sim.tflops=0"], ["sim.tflops"]),
        (["model=llama-tiny", "model.num_key_value_heads=3"],
         ["model.num_attention_heads", "model.num_key_value_heads"]),
        (["model=llama-tiny", "model.hidden_size=130"], ["model.hidden_size", "model.num_attention_heads"]),
        (["model=llama-tiny", "model.hidden_size=100"], ["model.hidden_size / model.num_attention_heads = 25", "even"]),
        (["model=llama3.1-8b", "model.rope_scaling.rope_type=yarn"], ["model.rope_scaling.rope_type", "null"]),
        (["model=llama-tiny", "data.seq_len=8192"], ["data.seq_len", "model.max_position_embeddings"]),
        (["model=llama-tiny", "schedule=zbv", "pipeline.degree=8", "pipeline.microbatches=16"],
         ["pipeline.degree", "model.num_hidden_layers", ">= 14"]),
    ],
)
def test_bad_input_names_the_knob(compose, overrides, knobs):
    with pytest.raises((ValueError, TypeError)) as info:
        compose(overrides)
    msg = str(root_cause(info.value))
    assert "\n" not in msg
    for knob in knobs:
        assert knob in msg, msg


@pytest.mark.parametrize("override", ["model.n_embed=64", "model.layer=4", "data.batch=4", "partition.boundary=[1]",
                                      "model.rope_scaling.factr=4"])
def test_misspelled_keys_fail(compose, override):
    model = {"model.n_": "model=gpt2", "model.rope": "model=llama3.2-1b"}.get(override[:8], "model=sleep")
    with pytest.raises(Exception, match=override.split("=")[0].split(".")[-1]):
        compose([model, override])


def test_sleep_ignores_the_batch_split_only_in_simulate(compose):
    # The sleep model's times do not depend on the batch: any pipeline.microbatches simulates.
    assert compose(["model=sleep", "mode=simulate", "pipeline.microbatches=32"]).microbatch_size == 1
    with pytest.raises(ValueError) as info:
        compose(["model=sleep", "pipeline.microbatches=32", "mode=train"])
    assert "data.batch_size" in str(root_cause(info.value))


def test_typed_config_without_hydra():
    cfg = Config(model=GPT2ModelConfig(name="gpt2-tiny", n_layer=2, n_head=2, n_embd=8, vocab_size=16,
                                       block_size=8), data=DataConfig(seq_len=8))
    assert cfg.model.num_layers == 4 and cfg.num_chunks == 2
    with pytest.raises(ValueError, match="data.seq_len"):
        Config(model=GPT2ModelConfig(block_size=32))  # default seq_len 64


GPT2_JSON = dict(model_type="gpt2", n_layer=3, n_head=4, n_embd=32, vocab_size=96, n_positions=64, n_inner=None,
                 activation_function="gelu_new", resid_pdrop=0.1)  # a GPT2LMHeadModel config.json, shortened


def test_gpt2_pretrained_config_json_sets_the_shape(compose, tmp_path):
    """model.pretrained's config.json sets GPT-2's five shape knobs over the preset, noting each
    change; model.dropout stays the command line's; knobs() (the constructor's arguments) has no
    `pretrained`."""
    (tmp_path / "config.json").write_text(json.dumps(GPT2_JSON))
    cfg = compose(["model=gpt2-tiny", f"model.pretrained={tmp_path}", "model.dropout=0.2", "data.seq_len=32"]).model
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.dropout) == (3, 4, 32, 96, 64, 0.2)
    assert cfg.pretrained_changes == ["n_layer=3 (was 8)", "n_embd=32 (was 128)", "vocab_size=96 (was 512)",
                                      "block_size=64 (was 256)"]  # n_head=4 is the preset's already
    assert "pretrained" not in cfg.knobs() and cfg.num_layers == 5
    assert compose(["model=gpt2-tiny"]).model.pretrained_changes == []


@pytest.mark.parametrize("content, words", [
    (None, ["model.pretrained=", "must be a Hugging Face folder", "config.json"]),
    ("{not json", ["config.json is not JSON", "save_pretrained"]),
    (dict(GPT2_JSON, n_positions=None), ["lacks 'n_positions'", "original config.json"]),
    (dict(GPT2_JSON, model_type="qwen2"), ["model_type='qwen2', not gpt2", "model=llama-tiny"]),
    (dict(GPT2_JSON, n_inner=64), ["sets n_inner=64", "4 x n_embd = 128"]),
    (dict(GPT2_JSON, n_embd=30), ["model.n_embd=30", "model.n_head=4"]),  # then the schema's own checks
])
def test_gpt2_pretrained_config_json_errors_are_one_line(compose, tmp_path, content, words):
    if isinstance(content, dict):  # None values: the key left out
        content = json.dumps({k: v for k, v in content.items() if v is not None})
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        compose(["model=gpt2-tiny", f"model.pretrained={tmp_path}", "data.seq_len=32"])
    msg = str(root_cause(info.value))
    assert "\n" not in msg and all(w in msg for w in words), msg
