"""Config composition: every shipped option composes into typed dataclasses; bad input fails clearly."""

from pathlib import Path

import pytest
from _chat import chat_tokenizer, chats, write_jsonl

from pipetrain.compose import CONF_DIR, recipe_files
from pipetrain.config import GPT2ModelConfig, Config, DataConfig, Mode, PartitionConfig
from pipetrain.schedules import registry

pytestmark = pytest.mark.pure

SCHEDULE_OPTIONS = sorted(p.stem for p in (Path(CONF_DIR) / "schedule").glob("*.yaml"))


def test_every_builtin_schedule_has_a_config_file():
    assert set(SCHEDULE_OPTIONS) == set(registry.names()) | {"custom", "auto"}


@pytest.mark.parametrize("name", [n for n in SCHEDULE_OPTIONS if n != "custom"])
def test_every_schedule_option_composes(compose, name):
    # P=4, M=16 is valid for every built-in schedule.
    cfg = compose([f"schedule={name}", "pipeline.degree=4", "pipeline.microbatches=16", "data.batch_size=16"])
    assert isinstance(cfg, Config)
    assert cfg.schedule.name == name
    assert cfg.pipeline.degree == 4 and cfg.pipeline.microbatches == 16


@pytest.mark.parametrize("recipe", sorted(recipe_files()))
def test_every_recipe_composes(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    assert isinstance(cfg, Config)


def test_defaults_are_typed(compose):
    cfg = compose([])
    assert cfg.mode is Mode.train  # the quickstart: GPT-2 tiny, 2 ranks, 1F1B
    assert isinstance(cfg.model, GPT2ModelConfig) and cfg.model.name == "gpt2-tiny"
    assert cfg.pipeline.degree == 2 and cfg.cluster.name == "local"
    assert cfg.schedule.name == "1f1b"
    assert isinstance(cfg.data, DataConfig) and (cfg.data.batch_size, cfg.data.seq_len) == (16, 64)
    assert isinstance(cfg.partition, PartitionConfig) and cfg.partition.name == "uniform"
    assert cfg.sim.tflops > 0


def test_cli_group_override_beats_recipe(compose):
    assert compose(["+recipe=sleep-p8"]).schedule.name == "zbv"
    cfg = compose(["+recipe=sleep-p8", "schedule=dualpipe"])
    assert cfg.schedule.name == "dualpipe"
    assert cfg.pipeline.degree == 8  # the rest of the recipe still applies


def test_misspelled_key_names_the_key(compose):
    with pytest.raises(Exception, match="degre"):
        compose(["pipeline.degre=4"])


def test_wrong_type_names_the_key(compose):
    with pytest.raises(Exception, match="pipeline.degree"):
        compose(["pipeline.degree=four"])


@pytest.mark.parametrize(
    "overrides, knob",
    [
        (["schedule=dualpipe", "pipeline.degree=3", "pipeline.microbatches=12"], "pipeline.degree"),
        (["schedule=dualpipe", "pipeline.degree=4", "pipeline.microbatches=6"], "pipeline.microbatches"),
        (["schedule=dualpipev", "pipeline.degree=4", "pipeline.microbatches=6"], "pipeline.microbatches"),
        (["schedule=interleaved_1f1b", "pipeline.degree=4", "pipeline.microbatches=6"], "pipeline.microbatches"),
        (["schedule=zbv", "schedule.virtual_stages=3"], "schedule.virtual_stages"),
        (["pipeline.degree=0"], "pipeline.degree"),
        (["sim.fb_overlap=1.5"], "sim.fb_overlap"),
        (["model=sleep", "pipeline.degree=8", "model.layers=4"], "model.layers"),
        (["model=sleep", "pipeline.degree=8", "model.layers=4"], "pipeline.degree"),
        (["model=gpt2", "data.batch_size=4"], "data.batch_size"),
        (["partition=manual"], "partition.boundaries"),
        (["sim.tflops=-1"], "sim.tflops"),
        (["schedule=custom"], "schedule.path"),
        # issue 25: a world the nodes do not have was planned for
        (["plan.world_size=8", "plan.nodes=2", "plan.devices_per_node=3"], "plan.devices_per_node"),
        (["plan.world_size=8", "plan.nodes=3"], "plan.nodes"),
        # issue 29: F&B overlap hides all-to-alls, in stages run node by node on CPU
        (["model=moe-tiny", "pipeline.fb_overlap=on"], "parallel.ep"),
        (["model=moe-tiny", "parallel.dp_shard=2", "parallel.ep=2", "pipeline.fb_overlap=on",
          "trainer.activation_checkpointing=true"], "trainer.activation_checkpointing"),
    ],
)
def test_cross_field_rules_name_the_knob(compose, overrides, knob):
    _refused_naming(compose, overrides, knob)


def _refused_naming(compose, overrides, knob):
    with pytest.raises((ValueError, TypeError)) as info:
        compose(overrides)
    err = info.value
    while err.__cause__ is not None:  # OmegaConf may wrap the __post_init__ error
        err = err.__cause__
    assert knob in str(err)
    assert "\n" not in str(err)  # one line


def test_fb_overlap_on_a_gpu_needs_a_hardware_queue_for_the_comm_stream(compose, monkeypatch):
    """The CUDA comm stream is built: on a GPU only CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue, where
    the all-to-alls would wait behind the compute) refuses pipeline.fb_overlap=on, before any rank starts."""
    run = ["model=moe-tiny", "parallel.dp_shard=2", "parallel.ep=2", "pipeline.fb_overlap=on"]
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert compose([*run, "trainer.device=cuda"]).pipeline.fb_overlap == "on"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for device in ("cuda", "auto"):
        _refused_naming(compose, [*run, f"trainer.device={device}"], "CUDA_DEVICE_MAX_CONNECTIONS")
    assert compose([*run, "trainer.device=cpu"]).pipeline.fb_overlap == "on"


# Options that need a value the user must supply; everything else composes as shipped.
NEEDS = {
    ("schedule", "custom"): ["schedule.path=/dev/null"],  # the file is read only when the plan is built
    ("partition", "manual"): ["partition.boundaries=[5]"],
    ("data", "text"): ["data.path=${oc.env:PIPETRAIN_TEST_TEXT}"],
    ("data", "tokens"): ["data.path=${oc.env:PIPETRAIN_TEST_BIN}"],
    ("data", "datasets"): ["data.path=${oc.env:PIPETRAIN_TEST_TEXT}"],  # a .txt: datasets' text builder, a line a row
    # chats, and a tokenizer folder with a chat template (tests/_chat.py)
    ("data", "sft"): ["data.path=${oc.env:PIPETRAIN_TEST_CHAT}", "data.tokenizer=hf",
                      "data.tokenizer_dir=${oc.env:PIPETRAIN_TEST_CHAT_TOKENIZER}"],
}


def all_shipped_options():
    conf = Path(CONF_DIR)
    return [(d.name, f.stem) for d in sorted(conf.iterdir()) if d.is_dir() and not d.name.startswith("_")
            for f in sorted(d.glob("*.yaml"))]


@pytest.mark.slow  # 4.5-10 s on 2 quiet cores, over 10 s on busy ones (the fast tier's 2 minutes)
def test_every_shipped_config_composes(compose, tmp_path, monkeypatch):
    """The walk over every option of every group in conf/ (recipes: test_every_recipe_composes)."""
    text, tokens = tmp_path / "t.txt", tmp_path / "t.bin"
    text.write_text("hello pipeline world. " * 2000)
    tokens.write_bytes(b"".join(i.to_bytes(2, "little") for i in range(200)) * 200)  # 40,000 uint16 tokens below 256
    monkeypatch.setenv("PIPETRAIN_TEST_TEXT", str(text))
    monkeypatch.setenv("PIPETRAIN_TEST_BIN", str(tokens))
    monkeypatch.setenv("PIPETRAIN_TEST_CHAT", str(write_jsonl(tmp_path / "chat.jsonl", chats(4))))
    monkeypatch.setenv("PIPETRAIN_TEST_CHAT_TOKENIZER", str(chat_tokenizer(tmp_path / "chat-tokenizer")))
    options = all_shipped_options()
    assert {g for g, _ in options} >= {"cluster", "data", "model", "partition", "pipeline", "schedule"}
    for group, name in options:
        extra = NEEDS.get((group, name), [])
        if group == "pipeline":
            extra = extra + ["data.batch_size=32"]  # p8: 32 microbatches
        cfg = compose([f"{group}={name}", *extra])
        assert isinstance(cfg, Config), (group, name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precision_choices_compose(compose, precision):
    assert compose([f"trainer.precision={precision}"]).trainer.precision == precision
    assert compose([]).trainer.precision == "fp32"  # the default


@pytest.mark.parametrize("precision", ["fp16", "BF16", "float32"])
def test_other_precisions_are_refused_in_one_line(compose, precision):
    with pytest.raises(ValueError) as info:
        compose([f"trainer.precision={precision}"])
    err = info.value
    while err.__cause__ is not None:  # OmegaConf may wrap the __post_init__ error
        err = err.__cause__
    text = str(err)
    assert "\n" not in text and "trainer.precision" in text and "fp32 or bf16" in text and precision in text
