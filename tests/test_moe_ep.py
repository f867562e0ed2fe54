"""Expert parallel x FSDP2 x pipeline on real gloo processes (8 ranks): equal to one process.

moe-tiny (8 experts, top-2, the auxiliary balance loss) at pp=2 x dp_shard=2 x ep=2: each rank keeps
4 of every MoE layer's 8 experts and exchanges tokens with its EP peer by all-to-all; experts are
FSDP2-sharded over their own (here one-rank) mesh with the whole dp as divide factor. Under 1f1b,
zbv (split backward: the all-to-all's backward runs inside B) and dualpipev (DualPipe's mirror) the
losses of steps 1-3 and the parameters after 3 clipped AdamW steps equal a single process training
on the same microbatches (test_tensor_parallel.py's bounds), and ep=1 at the same layout too: no
"gradients doubled with EP=2".
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import BASE, assert_ranks_equal, assert_resumes, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUT = ["model=moe-tiny", "pipeline.degree=2", "parallel.dp_shard=2"]
CASES = {"ep2-1f1b": ["parallel.ep=2", "schedule=1f1b"], "ep2-zbv": ["parallel.ep=2", "schedule=zbv"],
         "ep2-dualpipev": ["parallel.ep=2", "schedule=dualpipev"], "ep1-1f1b": ["schedule=1f1b"]}


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    train_spawned(compose, out, [*BASE, *LAYOUT], CASES, 4)  # 1-row microbatches: 8 rows / (dp 2 x M 4)
    # one process, the same 1-row microbatches (the balance loss is per microbatch)
    return out, reference(compose, "moe-tiny", out / "reference", ("pipeline.microbatches=8",))


@pytest.mark.parametrize("name", list(CASES))
def test_ep_pipelines_equal_one_process(runs, name):
    out, ref = runs
    assert_ranks_equal(out, name, ref, 4)


def test_an_ep2_checkpoint_resumes_at_ep1_within_1e4(compose, tmp_path):
    """Experts are saved whole under their global index (gathered over the EP group), so a checkpoint of
    ep=2 x pp=2 (aux_free: the router biases move too) loads at ep=1 x pp=2 and continues."""
    assert_resumes(compose, tmp_path, [*BASE, *LAYOUT, "model.moe.balance=aux_free"], ["parallel.ep=2"], [])
