"""Tensor parallel in the plan's search: one tp rank's memory and time terms, rows that carry tp,
the config a tp row trains, and bad plan.tp in one line (pure: no processes)."""

from __future__ import annotations

import json

import pytest

from pipetrain.compose import compose_config
from pipetrain.partition.costs import LayerCost
from pipetrain.planner.cmd import PLAN_FILE, apply_row, make_rows, run_plan
from pipetrain.schedules.tp_cost import tp_rank_layers
from pipetrain.schedules.reduce_cost import ring_factor

pytestmark = pytest.mark.pure

GPT = ["mode=plan", "model=gpt2-tiny", "data.seq_len=32", "data.batch_size=8", "plan.world_size=4",
       "plan.schedules=[1f1b]", "plan.microbatch_sizes=[1]", "plan.prune=false", "plan.memory_gb=1"]


def test_tp_rank_layers_split_compute_params_and_activations():
    layers = [LayerCost("embed", 0.0, 0.0, 0.0, params=1000, activation_bytes_per_token=8),
              LayerCost("h.0", 4.0, 4.0, 2.0, params=1001, activation_bytes_per_token=17 * 4 * 10),
              LayerCost("head", 2.0, 2.0, 2.0, params=10, activation_bytes_per_token=100)]
    kw = dict(tp=2, tokens=16, hidden=10, vocab=50, value_bytes=4, bandwidth_gbs=1.0)
    whole = tp_rank_layers(layers, sequence_parallel=False, **kw)
    all_reduce = ring_factor(2, all_reduce=True) * 16 * 10 * 4 / 1e9 * 1e3  # ms of one (N, C) all-reduce
    blk = whole[1]
    assert blk.f_ms == pytest.approx(2.0 + 2 * all_reduce) and blk.b_ms == pytest.approx(2.0 + 2 * all_reduce)
    assert blk.w_ms == pytest.approx(1.0) and blk.params == 501
    assert blk.activation_bytes_per_token == 17 * 40, "no replicated part given: tp_cost's bound (whole)"
    megatron = tp_rank_layers(layers, sequence_parallel=False, replicated_bytes_per_token=4 * 40, **kw)
    assert megatron[1].activation_bytes_per_token == pytest.approx(4 * 40 + 13 * 40 / 2)
    assert megatron[0].activation_bytes_per_token == 8 and megatron[2].activation_bytes_per_token == 100
    sp = tp_rank_layers(layers, sequence_parallel=True, replicated_bytes_per_token=4 * 40, **kw)
    assert sp[1].activation_bytes_per_token == 17 * 40 / 2
    assert tp_rank_layers(layers, sequence_parallel=False, **{**kw, "tp": 1}) == layers


def test_plan_searches_tp_and_a_tp_row_trains_as_planned(tmp_path):
    cfg = compose_config([*GPT, "plan.tp=[1,2]", "plan.pp=[2]"])
    run_plan(cfg, tmp_path)
    rows = json.loads((tmp_path / PLAN_FILE).read_text())["rows"]
    assert {(r["pp"], r["dp"], r["tp"]) for r in rows} == {(2, 2, 1), (2, 1, 2)}
    assert "pp2 x dp1 x tp2" in {r["layout"] for r in rows}
    by_tp = {r["tp"]: r for r in rows}
    for rank in (0, 1):  # weights, gradients and AdamW state per rank: half (norms and biases rounded in)
        one, two = (by_tp[t]["memory_per_rank"][rank]["states_gb"] for t in (1, 2))
        assert two == pytest.approx(one / 2, rel=0.02)
    assert by_tp[2]["microbatches"] == 2 * by_tp[1]["microbatches"], "tp ranks share their microbatches"
    ranked, _ = make_rows(cfg)
    row = next(r for r in ranked if r.candidate.tp == 2)
    run = apply_row(compose_config([*GPT, "mode=train", "schedule=auto", "plan.tp=[1,2]", "plan.pp=[2]"]), row)
    assert (run.parallel.tp, run.pipeline.degree, run.layout.world) == (2, 2, 4)
    sp_rows, _ = make_rows(compose_config([*GPT, "plan.tp=[2]", "plan.pp=[2]", "plan.sequence_parallel=true"]))
    assert sp_rows[0].candidate.sequence_parallel and sp_rows[0].pred_peak_gb < row.pred_peak_gb


@pytest.mark.parametrize("extra, message", [
    (["plan.tp=[3]"], "plan.tp lists 3, which does not divide the world of 4 ranks"),
    (["plan.tp=[4]", "model.n_head=2"], "plan.tp lists 4, which does not divide model.n_head=2"),
    (["plan.tp=[2]", "plan.sequence_parallel=true", "data.seq_len=33"], "set data.seq_len to a multiple of 2"),
    (["plan.tp=[0]"], "plan.tp must list tensor-parallel degrees >= 1"),
])
def test_bad_plan_tp_fails_in_one_line(extra, message):
    with pytest.raises(ValueError, match=message) as err:
        make_rows(compose_config([*GPT, *extra]))
    assert "\n" not in str(err.value)
