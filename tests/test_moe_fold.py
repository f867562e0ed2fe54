"""Context parallel on an MoE model and the experts folded over dp_shard x cp, on real gloo processes
(4 ranks each): equal to one process (issue #48).

moe-tiny (8 experts, top-2) with each sequence's positions split over cp=2 ranks: every cp rank routes
its own positions, the auxiliary balance loss counts over the whole sequences (the counts summed over
the cp group, models/moe_router.py balance_loss) and the aux_free counts over dp x cp. The experts fold
over the same ranks (parallel/layout.py): pp2 x cp2 with ep=1, pp2 x cp2 x ep2 (ep borrows cp's ranks:
4 ranks, not 8), dp_shard2 x cp2 x ep2 (ep over cp, edp over dp_shard) and dp_shard2 x cp2 x ep4 (ep
over dp_shard x cp, each rank 2 of the 8 experts); with tensor parallel tp2 x etp2 x dp_shard2 x ep2 (each expert
split in its width over tp), pp2 x tp2 (etp=2) and pp2 x tp2 x ep2 with etp=1 (ep over the tp ranks, each
dispatching half of the tokens they share), the same with sequence parallel (each tp rank routing its own half of
the positions) and cp2 x tp2 x ep4 with sequence parallel (a quarter each, counts summed over cp x tp); and node
by node under dualpipev with every F&B pair interleaved
(pipeline.fb_overlap=on) at pp2 x cp2 x ep2 and pp2 x tp2 x ep2 (etp=1). Losses of steps 1-3, the gradient
norm and every reduced gradient and the weights after 3 clipped AdamW steps equal a single process training on the
same 1-row microbatches (test_tensor_parallel.py's bounds: dense weights averaged over dp x cp, experts
over their edp ranks with the same divide factor, the norm counting each weight once). Under
balance=aux_free the router biases after 3 steps are bitwise those of one process at two foldings.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_ep import AUX_FREE
from test_tensor_parallel import BASE, assert_ranks_equal, assert_resumes, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# 1-row microbatches everywhere (the balance loss is per microbatch): 8 rows / (dp x M)
CP2 = ["parallel.cp=2"]
CASES = {"pp2-cp2": [*CP2, "pipeline.degree=2", "pipeline.microbatches=8"],
         "pp2-cp2-ep2": [*CP2, "pipeline.degree=2", "pipeline.microbatches=8", "parallel.ep=2"],
         "dp_shard2-cp2-ep2": [*CP2, "pipeline.degree=1", "parallel.dp_shard=2", "parallel.ep=2"],
         "dp_shard2-cp2-ep4": [*CP2, "pipeline.degree=1", "parallel.dp_shard=2", "parallel.ep=4"],
         # expert tensor parallel: each expert split over tp in its width, ep over dp_shard
         "tp2-etp2-dp_shard2-ep2": ["pipeline.degree=1", "parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"],
         "pp2-tp2-etp2": ["pipeline.degree=2", "pipeline.microbatches=8", "parallel.tp=2"],
         # experts whole (etp=1): ep over the tp ranks, each dispatching half of the tokens they share
         "pp2-tp2-ep2-etp1": ["pipeline.degree=2", "pipeline.microbatches=8", "parallel.tp=2", "parallel.ep=2",
                              "parallel.etp=1"],
         # and sequence parallel: each tp rank routes its own half of the positions, the balance counts summed over tp
         "pp2-tp2-ep2-etp1-sp": ["pipeline.degree=2", "pipeline.microbatches=8", "parallel.tp=2", "parallel.ep=2",
                                 "parallel.etp=1", "parallel.sequence_parallel=true"],
         # with cp too: each rank a quarter of every sequence, the counts summed over cp x tp, ep4 over cp x tp
         "cp2-tp2-ep4-etp1-sp": [*CP2, "pipeline.degree=1", "pipeline.microbatches=8", "parallel.tp=2", "parallel.ep=4",
                                 "parallel.etp=1", "parallel.sequence_parallel=true"],
         # node by node, every F&B pair's forward and backward interleaved (the cp and tp collectives inside nodes)
         "pp2-cp2-ep2-dualpipev-overlap": [*CP2, "pipeline.degree=2", "pipeline.microbatches=8", "parallel.ep=2",
                                           "schedule=dualpipev", "pipeline.fb_overlap=on"],
         "pp2-tp2-ep2-etp1-dualpipev-overlap": ["pipeline.degree=2", "pipeline.microbatches=8", "parallel.tp=2",
                                                "parallel.ep=2", "parallel.etp=1", "schedule=dualpipev",
                                                "pipeline.fb_overlap=on"]}
AUX_FREE_CASES = {f"{name}-aux_free": [*knobs, *AUX_FREE] for name, knobs in CASES.items()
                  if name in ("pp2-cp2-ep2", "dp_shard2-cp2-ep4")}
M8 = ("pipeline.microbatches=8",)


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-fold")
    train_spawned(compose, out, [*BASE, "model=moe-tiny"], {**CASES, **AUX_FREE_CASES}, 4)
    return out, {"aux_loss": reference(compose, "moe-tiny", out / "reference", M8),
                 "aux_free": reference(compose, "moe-tiny", out / "reference-aux-free", (*M8, *AUX_FREE))}


@pytest.mark.parametrize("name", [*CASES, *AUX_FREE_CASES])
def test_moe_with_cp_and_folded_experts_equals_one_process(runs, name):
    out, refs = runs
    assert_ranks_equal(out, name, refs["aux_free" if name.endswith("aux_free") else "aux_loss"], 4)


def test_aux_free_biases_are_bitwise_those_of_one_process_at_every_folding(runs):
    out, refs = runs
    ref = refs["aux_free"]["params"]
    biases = sorted(n for n in ref if n.endswith("expert_bias"))
    assert len(biases) == 8 and all(ref[n].abs().max() > 0 for n in biases)  # every router's bias moved
    for name in AUX_FREE_CASES:
        seen = set()
        for rank in range(4):
            got = torch.load(out / f"{name}.rank{rank}.pt")["params"]
            for b in (n for n in got if n.endswith("expert_bias")):
                assert torch.equal(got[b], ref[b]), (name, rank, b)
                seen.add(b)
        assert seen == set(biases), name


@pytest.mark.parametrize("saved", [["pipeline.degree=2", "parallel.cp=2", "parallel.ep=2"],
                                   ["pipeline.degree=1", "parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"]],
                         ids=["pp2-cp2-ep2", "tp2-etp2-dp_shard2-ep2"])
def test_a_folded_checkpoint_resumes_at_ep1_cp1_tp1_within_1e4(compose, tmp_path, saved):
    """Experts are saved as shards of the whole stacked weights (their global index on dim 0, under etp=2 each
    expert's width split too: the product of both splits) and dense weights whole, so a checkpoint of
    pp2 x cp2 x ep2 (ep over cp) or of tp2 x etp2 x dp_shard2 x ep2 (aux_free: the router biases move too)
    loads at ep=1 x cp=1 x tp=1 (pp=1) and continues."""
    base = [*BASE, "model=moe-tiny", "pipeline.microbatches=4", "model.moe.balance=aux_free"]
    assert_resumes(compose, tmp_path, base, saved, ["pipeline.degree=1"])
