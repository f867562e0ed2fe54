"""Document masks across real gloo processes (issue #46): pp=2 and tp=2 give each document's logits alone.

Two ranks, llama-tiny-shaped (GQA, RoPE, tied head) and GPT-2 (learned positions): at pp=2 (1F1B, every
rank computes the step's documents from the microbatch list; the second stage's attention gets them
though its input is an activation) the last stage's logits of a training step and of evaluate() equal the
documents run alone in one process within 1e-5, and the step's loss theirs; at tp=2 (heads split, the mask
unchanged) each rank's vocab-parallel logits are its slice of the same. One process: test_document_mask.py.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from test_document_mask import EOS, M, MB, SEQ, capture_logits, make, packed_microbatches, reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

NAMES = ("llama", "gpt2")


def rank_run(rank: int, world: int, out, how: str) -> None:
    from pipetrain.parallel.layout import Layout
    from pipetrain.parallel.mesh import build_groups
    from pipetrain.parallel.parallelize import Parallelize
    from pipetrain.parallel.tp import TPGroup
    from pipetrain.parallel.tp_plan import TensorParallel
    from pipetrain.partition.uniform import uniform_bounds
    from pipetrain.schedules import registry
    from pipetrain.train.pipeline import Transport, build_rank_pipeline

    for name in NAMES:
        with torch.device("meta"):
            model = make(name)
        if how == "pp":
            sched = registry.build("1f1b", 2, M, 1)
            rp = build_rank_pipeline(model, uniform_bounds(len(model.layers), 2), sched, rank, microbatch_size=MB,
                                     seq_len=SEQ, seed=0, transport=Transport(timeout_s=60, in_order=True))
        else:
            groups = build_groups(Layout(tp=2), "cpu")
            tp = TensorParallel(TPGroup(groups.tp_group, 2, groups.tp_index))
            rp = build_rank_pipeline(model, [range(len(model.layers))], registry.build("1f1b", 1, M, 1), 0,
                                     microbatch_size=MB, seq_len=SEQ, seed=0, parallelize=Parallelize(tp=tp))
        rp.executor.batch.document_eos = EOS
        last = any(s.is_last for s in rp.stages.values())
        seen = capture_logits(rp) if last else []
        loss = rp.train_step(packed_microbatches()).loss
        evaluated = rp.executor.evaluate(packed_microbatches())
        torch.save({"logits": seen, "loss": loss, "eval": evaluated}, out / f"{how}.{name}.rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("document_mask")
    for how in ("pp", "tp"):
        spawn(rank_run, 2, out, how)
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["pp", "tp"])
def test_packed_rows_give_each_documents_logits_across_ranks(runs, how, name):
    ref_logits, _, ref_loss = reference(name, packed_microbatches())
    ranks = [torch.load(runs / f"{how}.{name}.rank{r}.pt") for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["loss"] == pytest.approx(ref_loss, abs=1e-5)  # every rank holds the step's mean loss
        assert got["eval"] == pytest.approx(ref_loss, abs=1e-5)
        if how == "pp" and r == 0:
            assert got["logits"] == []  # the first stage holds no head
            continue
        assert len(got["logits"]) == 2 * M  # the step's, then evaluate()'s
        for i, logits in enumerate(got["logits"]):
            want = ref_logits[i % M]
            if how == "tp":  # vocab-parallel head: this rank's half of the vocabulary
                v = want.size(-1) // 2
                want = want[..., r * v:(r + 1) * v]
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
