"""summary.json of a resumed run (metrics/step.py RunSummary.to_json): says where it resumed and
which step its first loss is of, as the console's done line does."""

from __future__ import annotations

import pytest

from pipetrain.metrics import names
from pipetrain.metrics.step import RunSummary

pytestmark = pytest.mark.pure


def summary(**kw) -> dict:
    base = dict(steps=8, first_loss=6.25, final_loss=5.5, final_val_loss=None, skipped_steps=0, tokens=1024,
                step_time_s=0.1, tokens_per_s=10240.0)
    return RunSummary(**{**base, **kw}).to_json()


def test_summary_json_says_where_a_resumed_run_started_and_whose_first_loss_it_quotes():
    fresh = summary()
    assert fresh[names.RESUMED_AT] is None and fresh[names.FIRST_LOSS_STEP] == 1
    resumed = summary(resumed_at=4)  # a checkpoint that carried step 1's loss
    assert resumed[names.RESUMED_AT] == 4 and resumed[names.FIRST_LOSS_STEP] == 1
    old = summary(resumed_at=4, first_loss_step=5)  # a checkpoint from before first_loss
    assert old[names.FIRST_LOSS_STEP] == 5 and old[names.FIRST_LOSS] == 6.25
    assert all(k == "steps" or k.startswith("train/") or k.startswith("perf/") for k in old), sorted(old)
