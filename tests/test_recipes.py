"""The Llama and Qwen recipes: each composes into the model it names with the training settings
its header states, the header's GPU count and predicted GB are what the layout and the planner
give, and its CPU check line runs as written (tests/test_every_recipe_composes covers the rest)."""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import run_cli
from pipetrain.compose import recipe_files

LM_RECIPES = ("llama3.2-1b", "llama3.1-8b", "llama3.1-70b", "qwen2.5-7b", "qwen3-0.6b")


def header(name: str) -> str:
    """The recipe's leading comment, one line (the text a user reads before the YAML)."""
    lines = recipe_files()[name].read_text().splitlines()
    return " ".join(ln.lstrip("# ").strip() for ln in lines if ln.startswith("#"))


def cpu_check(name: str) -> list[str]:
    """The arguments of the header's `pipetrain ...` line that follows "CPU check"."""
    text = recipe_files()[name].read_text()
    m = re.search(r"CPU check.*\n#\s+pipetrain (.+)\n", text)
    assert m, f"recipes/{name}.yaml has no CPU check line"
    return shlex.split(m.group(1))


def short(x: float) -> str:
    """3e-4, 1.5e-4: a learning rate as the headers write it."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


@pytest.mark.pure
@pytest.mark.parametrize("name", LM_RECIPES)
def test_recipe_trains_its_model_with_the_stated_settings(compose, name):
    cfg = compose([f"+recipe={name}"])
    text = header(name)
    assert cfg.model.name == name and f"model={name}" in text
    o = cfg.optim
    assert (o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (0.9, 0.95, 0.1, 1.0)
    assert "betas 0.9/0.95, weight decay 0.1" in text and "clipping at 1.0" in text
    assert f"peak lr {short(o.lr)}" in text and f"after {o.warmup_steps} warm-up steps" in text
    assert o.min_lr == pytest.approx(o.lr / 100) and "to 1% of the peak" in text
    assert cfg.trainer.precision == "bf16" and "bf16 compute" in text
    tokens = cfg.data.batch_size * cfg.data.seq_len
    assert f"Sequences of {cfg.data.seq_len:,} tokens" in text
    assert f"{round(tokens / 2**20)}M tokens per step" in text and f"your tokens / {tokens:,}" in text
    assert cfg.data.seq_len <= cfg.model.max_position_embeddings


@pytest.mark.pure
@pytest.mark.parametrize("name", LM_RECIPES)
def test_recipe_layout_is_the_one_its_header_describes(compose, name):
    cfg = compose([f"+recipe={name}"])
    p, par, text = cfg.pipeline, cfg.parallel, header(name)
    gpus = p.degree * par.dp_replicate * par.dp_shard * par.tp
    assert all(f"{where} {gpus} GPUs" in text for where in ("pre-training on", "Layout:", "GPU-sized:"))
    assert f"pipeline.degree={p.degree}" in text and cfg.schedule.name in text
    for knob in ("dp_shard", "tp"):
        assert (f"parallel.{knob}={getattr(par, knob)}" in text) == (getattr(par, knob) > 1), knob
    assert par.tp == 1 or cfg.model.num_attention_heads % par.tp == 0  # composing checked the rest
    per_micro = cfg.data.batch_size // (par.dp * p.microbatches)
    assert per_micro * par.dp * p.microbatches == cfg.data.batch_size
    plural = "sequence" if per_micro == 1 else "sequences"
    assert f"M={p.microbatches} microbatches of {per_micro} {plural}" in text
    said = "activation checkpointing" in text.replace("no activation checkpointing", "")
    assert said == cfg.trainer.activation_checkpointing


@pytest.mark.pure
@pytest.mark.parametrize("name", LM_RECIPES)
def test_recipe_gpu_memory_is_the_planners_prediction(compose, name):
    from pipetrain.planner.predict import predict

    text = header(name)
    m = re.search(r"GPU-sized: \d+ GPUs of (\d+) GB \(the planner predicts ([\d.]+) GB on the fullest GPU", text)
    assert m, text
    command = re.search(r"python -m pipetrain\.planner\.predict (.+?) A CPU check", text).group(1).split()
    got = predict(compose(command))
    assert got["total_gb"] == pytest.approx(float(m.group(2)), abs=0.05)
    assert got["total_gb"] <= int(m.group(1))  # fits the GPUs it names


@pytest.mark.e2e
@pytest.mark.parametrize("name", LM_RECIPES)
def test_recipe_cpu_check_runs(name, tmp_path):
    args = cpu_check(name)
    assert args[0] == f"+recipe={name}"
    res = run_cli([*args, f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "makespan" in res.stdout and (tmp_path / "simulate.json").is_file()


@pytest.mark.pure
def test_the_deepseek_v3_recipe_is_the_reports_layout_and_settings(compose):
    """DeepSeek-V3's report (arXiv 2412.19437): 16-way PP x 64-way EP over 8 nodes x data parallel on 2048
    GPUs, no TP, DualPipe, 4K sequences, 15,360-sequence batches, AdamW 0.9/0.95/0.1, peak 2.2e-4 after 2K
    warm-up steps down to 2.2e-5, clip 1.0, MTP depth 1 at lambda 0.3, bias update speed 0.001."""
    cfg = compose(["+recipe=deepseek-v3"])
    text, p, par, o = header("deepseek-v3"), cfg.pipeline, cfg.parallel, cfg.optim
    assert cfg.model.name == "deepseek-v3" and "model=deepseek-v3" in text
    assert (p.degree, par.dp_shard, par.ep, par.tp, par.dp_replicate, par.cp) == (16, 128, 64, 1, 1, 1)
    gpus = p.degree * par.dp_shard
    assert all(f"{where} {gpus} GPUs" in text for where in ("pre-training on", "Layout:", "GPU-sized:"))
    assert "pipeline.degree=16 x parallel.dp_shard=128 with parallel.ep=64" in text and "64 GPUs of 8 nodes" in text
    assert cfg.schedule.name == "dualpipe" and "dualpipe (DualPipe" in text
    assert cfg.data.seq_len == 4096 and f"Sequences of {cfg.data.seq_len:,} tokens" in text
    assert cfg.data.batch_size == 15360 and f"your tokens / {cfg.data.batch_size * cfg.data.seq_len:,}" in text
    assert cfg.data.batch_size == par.dp * p.microbatches and f"M={p.microbatches} microbatches of 1 sequence" in text
    assert (o.lr, o.min_lr, o.warmup_steps, o.beta1, o.beta2, o.weight_decay, o.grad_clip) == \
        (2.2e-4, 2.2e-5, 2000, 0.9, 0.95, 0.1, 1.0)
    assert f"peak lr {short(o.lr)} after {o.warmup_steps} warm-up steps" in text and "clipping at 1.0" in text
    assert (cfg.model.mtp.depth, cfg.model.mtp.loss_weight) == (1, 0.3) and "model.mtp.loss_weight=0.3" in text
    moe = cfg.model.moe
    assert (moe.balance, moe.bias_update_rate) == ("aux_free", 0.001) and "update speed 0.001" in text
    assert cfg.trainer.precision == "bf16" and cfg.trainer.activation_checkpointing


@pytest.mark.pure
def test_the_deepseek_v3_recipe_fits_2048_80gb_gpus_as_its_header_and_the_planner_say(compose):
    """The header's GB is planner.predict's; mode=plan's search, held to the published layout by the recipe's
    plan.* knobs, gives that one row, feasible under 80 GB, with the same peak (less the 1.5 GB outside the
    allocator, which predict adds)."""
    from pipetrain.planner.cmd import make_rows
    from pipetrain.planner.predict import predict

    text = header("deepseek-v3")
    m = re.search(r"GPU-sized: 2048 GPUs of 80 GB \(the planner predicts ([\d.]+) GB on the fullest GPU", text)
    got = predict(compose(["+recipe=deepseek-v3", "trainer.device=cuda"]))
    assert got["total_gb"] == pytest.approx(float(m.group(1)), abs=0.05) and got["fits_plan_memory_gb"]
    rows, _ = make_rows(compose(["+recipe=deepseek-v3", "mode=plan"]))
    (row,) = rows
    c = row.candidate
    assert row.feasible and (c.schedule, c.pp, c.dp, c.ep, c.tp, c.microbatches, c.recompute) == \
        ("dualpipe", 16, 128, 64, 1, 120, True)
    assert row.pred_peak_gb == pytest.approx(got["peak_gb"], abs=0.05) and row.pred_peak_gb < 80
