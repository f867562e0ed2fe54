"""Context parallel's traffic in the metrics (pure): `cp/` per rank and the most of any rank
(metrics/names.py: cp_metrics), and the console's line (loggers/console.py)."""

from __future__ import annotations

import pytest

from pipetrain.loggers.console import metrics_line
from pipetrain.metrics import names

pytestmark = pytest.mark.pure

STEP = {"step": 1, "train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 1.0, "perf/tokens_per_s": 1.0,
        "perf/step_time_s": 1.0, "pipeline/bubble_measured": 0.2, "pipeline/bubble_simulated": 0.2,
        "memory/peak_gb": 3e-3, "memory/activations_gb/rank0": 1e-3, "memory/activations_gb/rank1": 2e-3}


def test_cp_metrics_are_per_rank_and_the_most_of_any_rank():
    ranks = [{"kv_bytes": 4e6, "comm_ms": 9.0, "gathered_kv_bytes": 2e6, "peak_kv_bytes": 3e6},
             {"kv_bytes": 8e6, "comm_ms": 5.0, "gathered_kv_bytes": 2e6, "peak_kv_bytes": 3e6}]
    out = names.cp_metrics(ranks)
    assert out[names.CP_KV_BYTES] == 8e6 and out["cp/kv_bytes/rank0"] == 4e6
    assert out[names.CP_COMM_MS] == 9.0 and out["cp/comm_ms/rank1"] == 5.0
    assert out[names.CP_GATHERED_GB] == pytest.approx(2e-3) and out[names.CP_PEAK_KV_GB] == pytest.approx(3e-3)
    assert names.cp_metrics([{}, {}]) == {}  # no context parallel: no cp/ names at all
    line = metrics_line({**STEP, **out}, 2, None)
    assert "| mem 3.0MB (act 2.0MB) | cp kv 8.0MB 9ms (gathered 2.0MB)" in line, line
    ring = names.cp_metrics([{**ranks[0], "gathered_kv_bytes": 0}])
    assert metrics_line({**STEP, **ring}, 2, None).endswith("| cp kv 4.0MB 9ms"), ring
    assert "cp " not in metrics_line(STEP, 2, None)
