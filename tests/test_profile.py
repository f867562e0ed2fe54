"""profile.enabled=true: one torch.profiler trace per rank, in the run directory, holding every
pipeline action of the captured steps as a `PP:<action>` range (and the operators under them)."""

import json

import pytest

from conftest import run_cli
from pipetrain.compose import compose_config
from pipetrain.schedules import registry

pytestmark = pytest.mark.e2e


def test_each_rank_writes_a_trace_with_its_action_ranges(tmp_path):
    run = tmp_path / "run"
    res = run_cli(["model=mlp", "schedule=zbh1", "pipeline.microbatches=4", "data.batch_size=8",
                   "trainer.max_steps=3", "trainer.log_every=1", "sim.timeline=false", "logging.timeline=false",
                   "profile.enabled=true", "profile.start_step=2", "profile.steps=2", f"hydra.run.dir={run}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "profile: steps 2-3 -> " in res.stdout
    schedule = registry.build("zbh1", 2, 4)
    for rank in range(2):
        events = json.loads((run / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        ranges = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("PP:")]
        # every action of this rank, once per captured step, in schedule order within a step
        want = [f"PP:{a}" for a in schedule.actions(rank)]
        got = [e["name"] for e in sorted(ranges, key=lambda e: e["ts"])]
        assert got == want * 2
        assert [e["name"] for e in events if e.get("name", "").startswith("step ")] in (["step 2", "step 3"],
                                                                                         ["step 3", "step 2"])
        assert any(e.get("name", "").startswith("aten::") for e in events)  # the operators are there too


def test_profile_window_must_fit_the_run():
    with pytest.raises(ValueError, match="past trainer.max_steps=3"):
        compose_config(["trainer.max_steps=3", "profile.enabled=true", "profile.start_step=3", "profile.steps=2"])
