"""deepseek-tiny (MLA + DeepSeekMoE: sigmoid scores in 4 groups, a shared expert, the aux-free bias) with its
experts folded over context and tensor parallel ranks, on real gloo processes (4 ranks each): equal to one
process (issue #48; test_moe_fold.py does the same for moe-tiny).

pp2 x cp2 x ep2: MLA's K and V all-gathered over cp (each cp rank its own positions, routed by itself), ep
borrowing cp's ranks; tp2 x cp2 x ep2 with etp=2: MLA's heads split over tp and its positions over cp at once,
each expert and the shared expert split in width over tp, ep over cp; pp2 x tp2 x ep2 with etp=1: experts whole,
ep over the tp ranks (each dispatching half of the tokens they share); dp_shard2 x cp2 x ep4: ep over dp_shard x cp,
each rank 2 of the 8 experts. Losses of steps 1-3, the gradient norm,
every reduced gradient and the weights after 3 clipped AdamW steps equal a single process on the same 1-row
microbatches (test_tensor_parallel.py's bounds); the router biases the aux-free update moved (from the counts
summed over dp x cp) are bitwise one process's.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import BASE, assert_ranks_equal, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

M8 = ("pipeline.microbatches=8",)  # 1-row microbatches: 8 rows / (dp=1 x M)
CASES = {"pp2-cp2-ep2": ["pipeline.degree=2", "parallel.cp=2", "parallel.ep=2"],
         "tp2-etp2-cp2-ep2": ["pipeline.degree=1", "parallel.tp=2", "parallel.cp=2", "parallel.ep=2"],
         "pp2-tp2-ep2-etp1": ["pipeline.degree=2", "parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
         # ep over dp_shard x cp (each rank 2 of the 8 experts): 8 rows / (dp 2 x M 4), 1-row microbatches still
         "dp_shard2-cp2-ep4": ["pipeline.degree=1", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=4",
                               "pipeline.microbatches=4"]}
# sequence parallel at etp=1: each tp rank routes and dispatches its own half of the positions (no token split),
# the aux-free counts summed over tp x dp x cp; the shared expert's and MLA's tp regions gather the sequence
SP = ["pipeline.degree=2", "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.sequence_parallel=true"]
CASES["pp2-tp2-ep2-etp1-sp"] = SP
SEQ_AUX = ["model.moe.balance=seq_aux_loss", "model.moe.aux_loss_coef=0.01"]  # DeepSeek-V3's sequence-wise loss
SEQ_AUX_CASES = {"pp2-tp2-ep2-etp1-sp-seq_aux": [*SP, *SEQ_AUX]}  # counts summed over tp, 1/tp of each rank's


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek-fold")
    train_spawned(compose, out, [*BASE, "model=deepseek-tiny", *M8], {**CASES, **SEQ_AUX_CASES}, 4)
    return out, {"aux_free": reference(compose, "deepseek-tiny", out / "reference", M8),
                 "seq_aux": reference(compose, "deepseek-tiny", out / "reference-seq-aux", (*M8, *SEQ_AUX))}


@pytest.mark.parametrize("name", [*CASES, *SEQ_AUX_CASES])
def test_deepseek_with_folded_experts_equals_one_process(runs, name):
    out, refs = runs
    assert_ranks_equal(out, name, refs["seq_aux" if name in SEQ_AUX_CASES else "aux_free"], 4)


def test_the_aux_free_biases_are_bitwise_those_of_one_process(runs):
    out, refs = runs
    ref = refs["aux_free"]
    biases = sorted(n for n in ref["params"] if n.endswith("expert_bias"))
    assert len(biases) == 7 and all(ref["params"][n].abs().max() > 0 for n in biases)  # 7 MoE blocks' routers moved
    for name in CASES:
        seen = set()
        for rank in range(4):
            got = torch.load(out / f"{name}.rank{rank}.pt")["params"]
            for b in (n for n in got if n.endswith("expert_bias")):
                assert torch.equal(got[b], ref["params"][b]), (name, rank, b)
                seen.add(b)
        assert seen == set(biases), name
