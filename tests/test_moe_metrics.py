"""The `moe/` metrics (metrics/names.py): per MoE block imbalance, aux loss, dropped share and
bias, merged over the measured ranks, in metrics.jsonl and on the console line of a real run; under
expert parallel the step's all-to-alls (runtime/collectives.py) in moe/a2a_* and in trace.json,
inside the actions that ran them."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from pipetrain.metrics import names


@pytest.mark.pure
def test_copies_of_a_block_average_and_the_mean_imbalance_is_over_blocks():
    got = names.moe_metrics([{"moe/layers.0/imbalance": 2.0, "moe/layers.0/aux_loss": 0.5},
                             {"moe/layers.0/imbalance": 1.0, "moe/layers.1/imbalance": 1.5}])
    assert got == {"moe/layers.0/aux_loss": 0.5, "moe/layers.0/imbalance": 1.5, "moe/layers.1/imbalance": 1.5,
                   names.MOE_IMBALANCE: 1.5}
    assert names.moe_metrics([{}, {}]) == {}


@pytest.mark.pure
def test_a2a_metrics_are_per_rank_their_mean_and_the_hidden_share():
    got = names.a2a_metrics([(10.0, 10.0), (30.0, 10.0)])
    assert got == {names.MOE_A2A_MS: 20.0, names.MOE_A2A_EXPOSED_MS: 10.0, names.MOE_A2A_OVERLAP: 0.5,
                   "moe/a2a_ms/rank0": 10.0, "moe/a2a_ms/rank1": 30.0,
                   "moe/a2a_exposed_ms/rank0": 10.0, "moe/a2a_exposed_ms/rank1": 10.0}
    assert names.a2a_metrics([(0.0, 0.0), (0.0, 0.0)]) == {}  # no expert parallel


def slices_by_rank(trace: dict, cat: str) -> dict[int, list[tuple[float, float, str]]]:
    """trace.json's slices of category `cat` per rank (its rows: "rank r ..."), as (start, end, name) in us."""
    rank_of = {e["tid"]: int(e["args"]["name"].split()[1]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    out: dict[int, list] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == cat:
            out.setdefault(rank_of[e["tid"]], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return out


def assert_inside_actions(trace: dict, cat: str, ops=("F", "B", "W", "BW", "F&B")) -> set[str]:
    """Every `cat` slice lies inside an action slice of its rank; returns their names."""
    actions: dict[int, list] = {}
    for op in ops:
        for r, spans in slices_by_rank(trace, op).items():
            actions.setdefault(r, []).extend(spans)
    inner = slices_by_rank(trace, cat)
    assert inner, f"no {cat} slices in the trace"
    for r, spans in inner.items():
        for t0, t1, name in spans:
            assert any(a0 - 1e-3 <= t0 and t1 <= a1 + 1e-3 for a0, a1, _ in actions[r]), (r, name, t0, t1)
    return {name for spans in inner.values() for _, _, name in spans}


@pytest.mark.e2e
def test_an_moe_run_logs_its_blocks_and_the_console_shows_the_imbalance(tmp_path):
    # pp=2 x dp_shard=2 x ep=2: the measured pipeline's two ranks each run their own all-to-alls
    res = run_cli(["model=moe-tiny", "pipeline.degree=2", "parallel.dp_shard=2", "parallel.ep=2",
                   "model.moe.balance=aux_free", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
                   "trainer.device=cpu", "logger=[console,jsonl,trace]", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    blocks = sorted(k for k in last if k.startswith("moe/layers.") and k.endswith("/imbalance"))
    assert blocks == [f"moe/layers.{i}/imbalance" for i in range(8)]  # both pipeline ranks' blocks
    assert all(last[k] >= 1.0 for k in blocks) and last[names.MOE_IMBALANCE] >= 1.0
    assert any(last[f"moe/layers.{i}/bias_abs_max"] > 0 for i in range(8))  # aux_free moved the biases
    assert "moe imbalance" in res.stdout
    # whole stages: every all-to-all blocks from its start to its end (exposed = total, nothing hidden)
    # pipeline 0 is global ranks 0 and 2 (pp outermost): every per-rank name is the global rank's
    assert [last[f"moe/a2a_ms/rank{r}"] > 0 for r in (0, 2)] == [True, True] and "moe/a2a_ms/rank1" not in last
    assert last[names.MOE_A2A_EXPOSED_MS] == last[names.MOE_A2A_MS] > 0 and last[names.MOE_A2A_OVERLAP] == 0
    assert "a2a " in res.stdout and "exposed" in res.stdout
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert assert_inside_actions(trace, "ep") == {"a2a:counts", "a2a:dispatch", "a2a:combine", "a2a:dispatch B",
                                                  "a2a:combine B"}
