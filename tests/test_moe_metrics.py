"""The `moe/` metrics (metrics/names.py): per MoE block imbalance, aux loss, dropped share and
bias, merged over the measured ranks, in metrics.jsonl and on the console line of a real run."""

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


@pytest.mark.e2e
def test_an_moe_run_logs_its_blocks_and_the_console_shows_the_imbalance(tmp_path):
    res = run_cli(["model=moe-tiny", "pipeline.degree=2", "model.moe.balance=aux_free", "trainer.max_steps=3",
                   "trainer.log_every=1", "trainer.eval_every=0", "trainer.device=cpu", "logger=[console,jsonl]",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    blocks = sorted(k for k in last if k.startswith("moe/layers.") and k.endswith("/imbalance"))
    assert blocks == [f"moe/layers.{i}/imbalance" for i in range(8)]  # both pipeline ranks' blocks
    assert all(last[k] >= 1.0 for k in blocks) and last[names.MOE_IMBALANCE] >= 1.0
    assert any(last[f"moe/layers.{i}/bias_abs_max"] > 0 for i in range(8))  # aux_free moved the biases
    assert "moe imbalance" in res.stdout
