"""Context parallel x pipeline / data / tensor parallel on real gloo processes (4 ranks): equal to one
process.

llama-tiny (GQA, tied embedding and head) with every sequence split over cp=2 ranks (head-tail
chunks, parallel/cp.py): cp=2 x pp=2 under 1f1b with K/V all-gathered and under zbv with the K/V
ring (split backward: the ring's dK/dV travel inside B), cp=2 x dp_shard=2 (FSDP2 over
dp_shard x cp), and cp=2 x tp=2 with sequence parallel and the ring (each tp rank's 2 query heads
and 1 KV head go around its cp group; sequence parallel splits a cp rank's positions again), that
again under selective recompute (its core attention's ring re-run in B). The
losses of steps 1-3 and the parameters after 3 clipped AdamW steps equal a single process training
on the same batches (test_tensor_parallel.py's bounds).
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import BASE, assert_ranks_equal, assert_resumes, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CASES = {"cp2-pp2-1f1b-allgather": ["pipeline.degree=2", "schedule=1f1b", "parallel.cp_rotate=allgather"],
         "cp2-pp2-zbv-ring": ["pipeline.degree=2", "schedule=zbv", "parallel.cp_rotate=ring"],
         "cp2-dp_shard2": ["pipeline.degree=1", "parallel.dp_shard=2", "pipeline.microbatches=2"],
         "cp2-tp2-sp-ring": ["pipeline.degree=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                             "parallel.cp_rotate=ring"],
         # selective recompute (parallel/recompute.py): the ring's attention re-runs inside B
         "cp2-tp2-sp-ring-selective": ["pipeline.degree=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                       "parallel.cp_rotate=ring", "trainer.recompute=selective"]}


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    train_spawned(compose, out, [*BASE, "model=llama-tiny", "parallel.cp=2"], CASES, 4)
    return out, reference(compose, "llama-tiny", out / "reference")


@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_one_process(runs, name):
    out, ref = runs
    assert_ranks_equal(out, name, ref, 4)


def test_a_cp2_checkpoint_resumes_at_cp1_within_1e4(compose, tmp_path):
    """Parameters are unsplit under context parallel (only positions are split), so a checkpoint of
    cp=2 x pp=2 loads at cp=1 x pp=2 and steps 3-4 repeat the uninterrupted run's losses."""
    assert_resumes(compose, tmp_path, [*BASE, "model=llama-tiny", "pipeline.degree=2"], ["parallel.cp=2"], [])
