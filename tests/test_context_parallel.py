"""Context parallel x pipeline / data parallel on real gloo processes (4 ranks): equal to one process.

llama-tiny (GQA, tied embedding and head) with every sequence split over cp=2 ranks (head-tail
chunks, parallel/cp.py): cp=2 x pp=2 under 1f1b with K/V all-gathered and under zbv with the K/V
ring (split backward: the ring's dK/dV travel inside B), and cp=2 x dp_shard=2 (FSDP2 over
dp_shard x cp). The losses of steps 1-3 and the parameters after 3 clipped AdamW steps equal a
single process training on the same batches (test_tensor_parallel.py's bounds).
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.plan import make_plan
from test_tensor_parallel import BASE, assert_equal_training, reference, train_cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CASES = {"cp2-pp2-1f1b-allgather": ["pipeline.degree=2", "schedule=1f1b", "parallel.cp_rotate=allgather"],
         "cp2-pp2-zbv-ring": ["pipeline.degree=2", "schedule=zbv", "parallel.cp_rotate=ring"],
         "cp2-dp_shard2": ["pipeline.degree=1", "parallel.dp_shard=2", "pipeline.microbatches=2"]}


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    cases = []
    for name, extra in CASES.items():
        config = compose([*BASE, "model=llama-tiny", "parallel.cp=2", *extra])
        assert config.layout.world == 4
        cases.append((name, config, make_plan(config)))
    spawn(train_cases, 4, out, cases)
    return out, reference(compose, "llama-tiny", out / "reference")


@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_one_process(runs, name):
    out, ref = runs
    names = set()
    for r in range(4):
        got = torch.load(out / f"{name}.rank{r}.pt")
        assert_equal_training(got, ref)
        names |= set(got["params"])
    assert names == set(ref["params"])


def test_a_cp2_checkpoint_resumes_at_cp1_within_1e4(compose, tmp_path):
    """Parameters are unsplit under context parallel (only positions are split), so a checkpoint of
    cp=2 x pp=2 loads at cp=1 x pp=2 and steps 3-4 repeat the uninterrupted run's losses."""
    from pipetrain.launch import launch
    from pipetrain.train import checkpoint_dirs as dirs
    from test_checkpoint import losses

    base = [*BASE, "model=llama-tiny", "pipeline.degree=2", "trainer.max_steps=4", "trainer.log_every=1"]
    runs = {}
    for name, extra in (("cp2", ["parallel.cp=2", "trainer.ckpt_every=2"]), ("cp1", [])):
        config = compose([*base, *extra, *([f"trainer.resume={dirs.step_dir(runs['cp2'], 2)}"] if runs else [])])
        launch(config, make_plan(config), tmp_path / name)
        runs[name] = tmp_path / name
    ref, got = losses(runs["cp2"]), losses(runs["cp1"])
    assert sorted(got) == [3, 4]
    for s in got:
        assert abs(got[s] - ref[s]) < 1e-4, (s, got[s], ref[s])
