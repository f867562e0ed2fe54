"""plan.device: the catalog and its one-line refusal, the links a layout's groups cross, a GEMM's efficiency by
shape, and two published runs held within 15% so the device model cannot drift silently (issue 50)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipetrain.compose import compose_config
from pipetrain.config.devices import CATALOG, device_spec
from pipetrain.planner.cmd import make_rows
from pipetrain.planner.compute import Timing, gemm_ms
from pipetrain.planner.topology import layout_links

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def published_rows() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "bench" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {row["name"]: row | {"flops": module.megatron_flops} for row in module.ROWS}


def test_the_catalog_names_its_devices_and_a_source_for_every_figure():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h800", "h200", "b200", "mi300x"} <= set(CATALOG)
    for spec in CATALOG.values():
        assert set(spec.sources) >= {"bf16_tflops", "fp8_tflops", "memory_gb", "memory_tbs", "link_gbs",
                                     "network_gbs", "devices_per_node"}, spec.name
        assert spec.bf16_tflops > 0 and spec.memory_gb > 0 and spec.devices_per_node >= 1
    with pytest.raises(ValueError, match="plan.device='tpu' is not in the catalog: choose one of local, a100-40gb"):
        device_spec("tpu")


def test_plan_device_sets_the_memory_budget_unless_memory_gb_is_given():
    base = ["mode=plan", "model=gpt2-tiny"]
    assert compose_config([*base, "plan.device=h200"]).plan.memory_budget_gb == 141.0
    assert compose_config([*base, "plan.device=h200", "plan.memory_gb=100"]).plan.memory_budget_gb == 100.0
    assert compose_config(base).plan.memory_budget_gb == 80.0  # local: as before


def test_groups_cost_their_slowest_link_with_tp_fastest():
    a100 = CATALOG["a100-80gb"]
    links = layout_links(a100, 8, pp=4, dp=8, cp=1, tp=8)
    assert not links.tp.crosses_nodes and links.dp.crosses_nodes and links.pp.crosses_nodes
    assert links.tp.gbs == pytest.approx(600 * 0.4)  # one direction of NVLink at NCCL's bus bandwidth
    assert links.dp.gbs == pytest.approx(200 / 8 * 0.85)  # one member per node: one NIC's share
    inner = layout_links(a100, 8, pp=1, dp=32, cp=1, tp=1)  # dp's rings leave each node through its 8 NICs
    assert inner.dp.gbs == pytest.approx(200 * 0.85) and inner.crossing() == "dp"
    assert layout_links(a100, 8, pp=2, dp=1, cp=1, tp=4).crossing() == ""  # 8 ranks: one node


def test_a_gemm_loses_efficiency_when_a_dimension_is_small():
    t = Timing(CATALOG["h100-sxm"])
    big = 2 * 8192**3 / (gemm_ms(8192, 8192, 8192, t) / 1e3) / 1e12
    skinny = 2 * 8192 * 8192 * 64 / (gemm_ms(8192, 8192, 64, t) / 1e3) / 1e12
    assert 0.65 * 989 < big < 0.78 * 989 and skinny < 0.5 * big


@pytest.mark.parametrize("name", ["megatron-7.5b", "torchtitan-8b-8gpu"])
def test_a_published_run_is_predicted_within_15_percent(name):
    row = published_rows()[name]
    rows, meta = make_rows(compose_config(["mode=plan", *row["model"], *row["cluster"], *row["layout"]]))
    best = next(r for r in rows if r.feasible)
    gpus, c = meta["world_size"], best.candidate
    if row["metric"] == "tflops_per_gpu":  # Megatron-LM's count: its eq. 3 over the predicted step
        predicted = row["flops"](row["shape"], batch=c.dp * c.microbatches * c.microbatch_size) / (
            best.pred_step_ms / 1e3) / gpus / 1e12
    else:
        predicted = best.tokens_per_s / gpus
    assert predicted == pytest.approx(row["published"], rel=0.15), (name, predicted)
    assert 0 < best.mfu < 1 and best.hw_tflops_per_device >= best.tflops_per_device


def test_a_model_that_does_not_fit_replicated_plans_fsdp2_first():
    rows, meta = make_rows(compose_config(["mode=plan", "model=gpt2", "model.vocab_size=50304", "plan.device=h100-sxm",
                                           "plan.memory_gb=1.5",
                                           "data.seq_len=256", "plan.global_batch=16", "plan.schedules=[1f1b]",
                                           "plan.microbatch_sizes=[1]", "plan.recompute=[true]"]))
    assert "FSDP2 (dp_shard) rows first" in meta["note"]  # 124M parameters x 16 bytes: 2 GB
    assert any(r.candidate.dp_shard and r.feasible for r in rows)
    assert all(r.feasible for r in rows if not r.candidate.dp_shard and r.candidate.dp > 1)
    assert {r.candidate.tp for r in rows} == {1, 2, 4}  # plan.tp null on a device: 1..8 dividing n_head=12, V
