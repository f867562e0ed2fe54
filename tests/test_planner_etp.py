"""The planner searches expert tensor parallel (issue #48): an MoE model's rows at tp > 1 come at etp = tp (each
expert split in its width, ep folded over dp x cp) and at etp = 1 (experts whole, ep taking the tp ranks too, a
multiple of tp dividing dp x cp x tp), each row's `etp` in plan.json, plan.csv and the layout's label; every row's
config passes the run's folding check; the all-to-all carries the tokens a rank dispatches (1/tp of them at
etp = 1) and the experts' states follow the folding."""

from __future__ import annotations

import csv
import json

import pytest

from pipetrain.compose import compose_config
from pipetrain.plan import layer_costs
from pipetrain.planner.cmd import PLAN_CSV, PLAN_FILE, apply_row, make_rows, run_plan

pytestmark = pytest.mark.pure

PLAN = ["mode=plan", "data.seq_len=64", "data.batch_size=8", "plan.world_size=8", "plan.schedules=[1f1b]",
        "plan.microbatch_sizes=[1]", "plan.prune=false", "plan.tp=[1,2]", "plan.cp=[1,2]", "plan.pp=[1,2]"]


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("etp")
    run_plan(compose_config([*PLAN, "model=moe-tiny", "plan.ep=[1,2,4]"]), out)
    return json.loads((out / PLAN_FILE).read_text())["rows"], list(csv.DictReader((out / PLAN_CSV).open()))


def test_moe_rows_at_tp_come_at_etp_tp_and_at_etp_1_folded_as_the_run_folds(moe_plan):
    rows, table = moe_plan
    assert all(r["etp"] == 1 for r in rows if r["tp"] == 1)
    at_tp = {(r["pp"], r["dp"], r["cp"], r["ep"], r["etp"]) for r in rows if r["tp"] == 2}
    assert {r[4] for r in at_tp} == {1, 2}
    for _pp, dp, cp, ep, etp in at_tp:
        if etp == 2:
            assert dp * cp % ep == 0
        else:  # ep takes tp's ranks whole
            assert ep % 2 == 0 and dp * cp * 2 % ep == 0
    assert (2, 1, 2, 4, 1) in at_tp and (2, 1, 2, 4, 2) not in at_tp  # ep4 over cp2 x tp2: only with experts whole
    assert "pp2 x dp1 (ep4, etp1) x cp2 x tp2" in {r["layout"] for r in rows}
    assert [(int(t["tp"]), int(t["ep"]), int(t["etp"])) for t in table] == [(r["tp"], r["ep"], r["etp"]) for r in rows]


def test_every_row_trains_as_its_config_folds(moe_plan):
    """apply_row's config passes Config's checks (parallel/layout.py fold_error) and lays out the row's etp."""
    rows, _ = moe_plan
    config = compose_config([*PLAN, "model=moe-tiny", "plan.ep=[1,2,4]"])
    ranked, _ = make_rows(config)
    assert len(ranked) == len(rows)
    for row in ranked:
        layout = apply_row(config, row).layout
        assert (layout.tp, layout.ep, layout.etp) == (row.candidate.tp, row.candidate.ep, row.candidate.expert_tp)


def test_a_dense_model_has_no_etp_1_rows(tmp_path):
    run_plan(compose_config([*PLAN, "model=llama-tiny"]), tmp_path)
    rows = json.loads((tmp_path / PLAN_FILE).read_text())["rows"]
    assert {r["tp"] for r in rows} == {1, 2} and all(r["etp"] == r["tp"] and r["ep"] == 1 for r in rows)


def test_experts_whole_dispatch_1_over_tp_of_the_tokens_and_keep_their_width():
    """moe-tiny at tp=2 x ep=2 (2 x 64 tokens per microbatch, fp32): at etp=1 each tp rank dispatches 64 of the
    128 tokens (half the all-to-all bytes of etp=2) and stores its 4 experts whole (3 x 128 x 128 each), at etp=2
    4 experts at half their width; the dense weights and the compute (expert GEMMs 1/tp either way) alike."""
    sim = ["mode=simulate", "model=moe-tiny", "data.seq_len=64", "data.batch_size=16", "pipeline.degree=2",
           "pipeline.microbatches=4", "parallel.dp_shard=2", "schedule=1f1b", "parallel.tp=2", "parallel.ep=2",
           "cluster.ep_bandwidth_gbs=2"]
    whole, split = (layer_costs(compose_config([*sim, f"parallel.etp={e}"])) for e in (1, 2))
    a2a = 2 * (128 * 2 * 128 * 4) / 2 / 2e9 * 1e3  # dispatch + combine of 128 tokens x top-2, half off the rank
    for w, s in zip(whole[1:-1], split[1:-1]):  # every block is MoE
        assert s.comm_f_ms == pytest.approx(a2a) and w.comm_f_ms == pytest.approx(a2a / 2)
        assert (w.f_ms, w.b_ms, w.w_ms) == pytest.approx((s.f_ms - a2a / 2, s.b_ms - a2a / 2, s.w_ms))
        assert w.experts_params == 4 * 3 * 128 * 128 and s.experts_params == 2 * 3 * 128 * 128
        assert w.params - w.experts_params == s.params - s.experts_params
    assert whole[0] == split[0] and whole[-1] == split[-1]


def test_expert_states_shard_over_the_edp_ranks_of_either_folding(moe_plan):
    """Under FSDP2 a rank's expert states are E / (dp x cp x tp) of them at etp = 1 (E/ep whole, over
    dp x cp x tp / ep ranks) as at etp = tp (E/(ep x tp), over dp x cp / ep): the same bytes, less a2a at etp = 1."""
    rows, _ = moe_plan
    pairs = {}
    for r in rows:
        if r["tp"] == 2 and r["ep"] == 2:
            pairs.setdefault((r["pp"], r["dp"], r["cp"], r["v"], r["microbatches"], r["recompute"]), {})[r["etp"]] = r
    both = [p for p in pairs.values() if len(p) == 2]
    assert both
    for p in both:
        assert [m["states_gb"] for m in p[1]["memory_per_rank"]] == pytest.approx(
            [m["states_gb"] for m in p[2]["memory_per_rank"]])


def test_sequence_parallel_rows_of_an_moe_model_keep_the_experts_whole(tmp_path):
    """Sequence parallel with MoE runs at etp = 1 only (config/parallel.py check_experts): so are its rows."""
    run_plan(compose_config([*PLAN, "model=moe-tiny", "plan.ep=[1,2,4]", "plan.sequence_parallel=true"]), tmp_path)
    rows = [r for r in json.loads((tmp_path / PLAN_FILE).read_text())["rows"] if r["tp"] == 2]
    assert rows and all(r["sequence_parallel"] and r["etp"] == 1 and r["ep"] in (2, 4) for r in rows)
