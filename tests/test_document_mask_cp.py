"""Document masks under context parallel (issue #46) on real gloo processes: cp=2, allgather and ring.

Each rank holds load-balanced chunks of every row (parallel/cp.py positions); the row's documents come
from the whole row and are cut as its positions are (Parallelize.local_documents). llama-tiny-shaped
(GQA, RoPE at per-document positions, tied head): each rank's logits of a training step and of evaluate()
equal, at its positions, each document run alone in one process within 1e-5; the step's loss theirs;
the gradients, averaged over the two ranks (each holds the mean over its half of the positions), those
of one process within tests/_parity.py's error model. The ring skips a K/V block that shares no document
with an earlier-or-equal query of the rank (counted), and rows whose documents end at the chunk edges
make both ranks skip the other's block in every forward and backward, with the same logits.
GPT-2 has no context-parallel attention (no cp_plan): the config refuses parallel.cp with it.
Through the trainer with data=datasets: test_document_mask_cp_train.py.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from _parity import gradient_excess
from test_document_mask import EOS, M, MB, SEQ, capture_logits, make, packed_microbatches, reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CP = 2
CHUNK = SEQ // (2 * CP)  # rank 0 holds positions 0-5 and 18-23, rank 1 6-17


def edge_microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows whose documents end where the chunks do (EOS at 5 and 17, and inside them): rank 0's late
    queries (18-23) and rank 1's (6-17) share no document with the other rank's keys."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(4, 64, (M * MB, SEQ + 1), generator=g)
    rows[:, [CHUNK - 1, 3 * CHUNK - 1, 2, 9, 20]] = EOS
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows.view(M, MB, SEQ + 1)]


def rank_run(rank: int, world: int, out, rotate: str) -> None:
    from pipetrain.parallel.cp import context_parallel, local_positions
    from pipetrain.parallel.layout import Layout
    from pipetrain.parallel.mesh import build_groups
    from pipetrain.parallel.parallelize import Parallelize
    from pipetrain.schedules import registry
    from pipetrain.train.pipeline import Transport, build_rank_pipeline

    layout = Layout(cp=world)
    groups = build_groups(layout, "cpu")
    context = context_parallel(groups, SEQ, rotate)
    par = Parallelize(cp=context)
    with torch.device("meta"):
        model = make("llama")
    rp = build_rank_pipeline(model, [range(len(model.layers))], registry.build("1f1b", 1, M, 1), 0,
                             microbatch_size=MB, seq_len=SEQ, seed=0, parallelize=par,
                             transport=Transport(group=groups.pp_group, group_ranks=groups.pipeline_ranks,
                                                 pipelines=layout.pipelines()))
    rp.executor.batch.document_eos = EOS
    seen = capture_logits(rp)
    record = {}
    for name, mbs in (("packed", packed_microbatches()), ("edges", edge_microbatches())):
        whole = (torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))
        docs = par.local_documents(whole, EOS, M)
        local = [local_positions(mb, context) for mb in mbs]
        for p in rp.parameters():
            p.grad = None
        context.stats.take()
        loss = rp.train_step(local, docs=docs).loss
        (stage,) = rp.stages.values()  # a tied head's copy holds the summed gradient (GradSync): one name each
        grads = {stage.tied.get(n, n): p.grad.clone() for _, n, p in rp.named_parameters()}
        evaluated = rp.executor.evaluate(local, docs)
        record[name] = {"loss": loss, "eval": evaluated, "grads": grads, "logits": [t.clone() for t in seen],
                        "skipped": context.stats.take()["skipped_blocks"]}
        seen.clear()
    torch.save(record, out / f"{rotate}.rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("document_mask_cp")
    for rotate in ("allgather", "ring"):
        spawn(rank_run, CP, out, rotate)
    return out


@pytest.mark.parametrize("data", ["packed", "edges"])
@pytest.mark.parametrize("rotate", ["allgather", "ring"])
def test_cp2_gives_each_documents_logits_and_gradients(runs, rotate, data):
    from pipetrain.parallel.cp import positions

    mbs = packed_microbatches() if data == "packed" else edge_microbatches()
    ref_logits, ref_grads, ref_loss = reference("llama", mbs)
    ranks = [torch.load(runs / f"{rotate}.rank{r}.pt")[data] for r in range(CP)]
    for r, got in enumerate(ranks):
        assert got["loss"] == pytest.approx(ref_loss, abs=1e-5)  # the mean over both ranks' positions
        assert got["eval"] == pytest.approx(ref_loss, abs=1e-5)
        assert len(got["logits"]) == 2 * M  # the step's, then evaluate()'s
        mine = positions(SEQ, CP, r)
        for i, logits in enumerate(got["logits"]):
            torch.testing.assert_close(logits, ref_logits[i % M][:, mine], atol=1e-5, rtol=0)
    # each rank's gradient is of the mean over its positions (half of them): the whole mean's is their mean
    grads = {n: sum(got["grads"][n] for got in ranks) / CP for n in ranks[0]["grads"]}
    excess = gradient_excess(grads, ref_grads, step=1)
    assert max(excess.values()) <= 1.0, sorted(excess.items(), key=lambda kv: -kv[1])[:3]


def test_the_ring_skips_blocks_that_share_no_document(runs):
    """Per layer and microbatch a rank meets one block of the other rank, in the forward and in the backward
    (evaluate(): forward only). Rows cut at the chunk edges: every such block skipped, on both ranks; the
    packed rows (documents crossing the edges): none. Allgather has no blocks to skip."""
    layers = 2
    for r in range(CP):
        ring = torch.load(runs / f"ring.rank{r}.pt")
        assert ring["edges"]["skipped"] == layers * M * 3  # step: forward + backward; evaluate: forward
        assert ring["packed"]["skipped"] == 0
        gathered = torch.load(runs / f"allgather.rank{r}.pt")
        assert gathered["edges"]["skipped"] == gathered["packed"]["skipped"] == 0
