"""trainer.compile=true on real gloo processes: every layer of every stage compiled with
torch.compile (in place, names unchanged), tp=2 (the TP collectives inside compiled blocks;
pipeline.degree=1 keeps it to 2 ranks compiling at once), llama-tiny: the losses of steps 1-3 equal the eager single process within 1e-4,
and the weights after 3 steps likewise. Slow: CPU compilation takes about half a minute per
rank here. (Schedules that split the backward into B and W are refused under compile: plan.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import spawn
from pipetrain.plan import make_plan
from test_tensor_parallel import BASE, reference, train_cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_compiled_stages_train_as_eager(compose, tmp_path: Path):
    config = compose([*BASE, "model=llama-tiny", "pipeline.degree=1", "parallel.tp=2", "schedule=1f1b",
                      "trainer.compile=true"])
    spawn(train_cases, 2, tmp_path, [("compiled", config, make_plan(config))])
    ref = reference(compose, "llama-tiny", tmp_path / "eager")
    for rank in range(2):
        got = torch.load(tmp_path / f"compiled.rank{rank}.pt")
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-4, (got["losses"], ref["losses"])
        assert got["params"]
        for name, t in got["params"].items():
            torch.testing.assert_close(t, ref["params"][name], rtol=0, atol=1e-4, msg=name)
