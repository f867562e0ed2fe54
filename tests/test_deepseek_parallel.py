"""deepseek-tiny (MLA + DeepSeekMoE) under every parallelism on real gloo processes (4 ranks): equal to one
process.

MLA's dense blocks (model.moe=null) at tp=2 x pp=2 under 1f1b (each tp rank its 2 heads' q_b_proj, kv_b_proj
and o_proj slices, the compressions q_a_proj / kv_a_proj_with_mqa and their norms whole with their partial
gradients summed over tp), with sequence parallel and activation recompute under zbv, and at cp=2 x pp=2 with
K (d_n + d_r per head) and V (d_v: another width) all-gathered under 1f1b and passed around the ring under zbv.
The DeepSeek-V3 step (issue #47): the MoE model with multi-token prediction (model.mtp.depth=1) at pp=2 x
dp_shard=2 x ep=2 (each rank 4 of every MoE block's 8 experts, the MTP block's too, sigmoid scores in 4 groups,
the aux-free bias moved after every step from the counts summed over dp) under 1f1b (MTP on the last rank), zbv
and dualpipev with pipeline.fb_overlap=on (MTP on rank 0 beside the embedding; F&B pairs run node by node, the
all-to-alls of one half under the other's compute). Each case: the losses and mtp/loss_1 of steps 1-3, every
step's reduced gradients and the parameters after 3 clipped AdamW steps equal a single process on the same
microbatches (test_tensor_parallel.py's bounds). A checkpoint of that dualpipev run resumes at ep=1 under 1f1b.
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import BASE, assert_ranks_equal, assert_resumes, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DENSE = {"tp2-pp2-1f1b": ["pipeline.degree=2", "parallel.tp=2", "schedule=1f1b"],
         "tp2-pp2-zbv-sp-recompute": ["pipeline.degree=2", "parallel.tp=2", "schedule=zbv",
                                      "parallel.sequence_parallel=true", "trainer.activation_checkpointing=true"],
         "cp2-pp2-1f1b-allgather": ["pipeline.degree=2", "parallel.cp=2", "schedule=1f1b",
                                    "parallel.cp_rotate=allgather"],
         "cp2-pp2-zbv-ring": ["pipeline.degree=2", "parallel.cp=2", "schedule=zbv", "parallel.cp_rotate=ring"]}
MOE = {"ep2-1f1b": ["schedule=1f1b"], "ep2-zbv": ["schedule=zbv"],
       "ep2-dualpipev-overlap": ["schedule=dualpipev", "pipeline.fb_overlap=on"]}
MOE_LAYOUT = ["pipeline.degree=2", "parallel.dp_shard=2", "parallel.ep=2"]
MTP = ("model.mtp.depth=1",)


@pytest.fixture(scope="module")
def dense_runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("mla")
    train_spawned(compose, out, [*BASE, "model=deepseek-tiny", "model.moe=null"], DENSE, 4)
    return out, reference(compose, "deepseek-tiny", out / "reference", ("model.moe=null",))


@pytest.fixture(scope="module")
def moe_runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek-ep")
    train_spawned(compose, out, [*BASE, "model=deepseek-tiny", *MTP, *MOE_LAYOUT], MOE, 4)  # 1-row microbatches
    return out, reference(compose, "deepseek-tiny", out / "reference", ("pipeline.microbatches=8", *MTP))


@pytest.mark.parametrize("name", list(DENSE))
def test_mla_under_tp_and_cp_equals_one_process(dense_runs, name):
    out, ref = dense_runs
    assert_ranks_equal(out, name, ref, 4)


@pytest.mark.parametrize("name", list(MOE))
def test_deepseek_v3_step_equals_one_process(moe_runs, name):
    out, ref = moe_runs
    assert ref["parts"][0].keys() == {"mtp/loss_1"}
    assert_ranks_equal(out, name, ref, 4)


def test_an_mtp_checkpoint_of_the_deepseek_v3_step_resumes_at_ep1_under_1f1b(compose, tmp_path):
    """The MTP depth's weights (its block's experts saved whole by global index, like every MoE block's) and
    the router biases saved at ep=2 under dualpipev (MTP on rank 0) load at ep=1 under 1f1b (MTP on rank 1)."""
    assert_resumes(compose, tmp_path, [*BASE, "model=deepseek-tiny", *MTP, *MOE_LAYOUT[:2]],
                   ["parallel.ep=2", "schedule=dualpipev", "pipeline.fb_overlap=on"], ["schedule=1f1b"],
                   keys=("train/loss", "mtp/loss_1"))
