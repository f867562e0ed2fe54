"""Document masks under context parallel through the trainer (issue #46): `data=datasets` packs short
documents of a local jsonl into rows of 16 tokens (many documents per row, rows that start and end
mid-document), llama-tiny at cp=2 x pp=2 (4 gloo ranks) with K/V all-gathered (1f1b) and with the ring
(zbv: the ring's dK/dV inside B), every rank cutting the rows' documents as it cuts their positions
(Parallelize.local_documents). The losses of steps 1-3, every step's reduced gradients (tests/_parity.py's
error model) and the weights after 3 AdamW steps equal one process (pipeline.degree=1, cp=1) training on the
same rows with document masks (test_tensor_parallel.py's bounds). Attention alone: test_document_mask_cp.py.
"""

from __future__ import annotations

import json
import random

import pytest
from test_tensor_parallel import BASE, assert_ranks_equal, reference, train_spawned

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CASES = {"cp2-pp2-1f1b-allgather": ["schedule=1f1b", "parallel.cp_rotate=allgather"],
         "cp2-pp2-zbv-ring": ["schedule=zbv", "parallel.cp_rotate=ring"]}


def short_documents(path) -> None:
    """400 documents of 1-6 words (~4-40 byte tokens): a 16-token row holds several."""
    words = "the quick brown fox jumps over a lazy dog while pipelines train models".split()
    r = random.Random(0)
    with open(path, "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(r.randint(1, 6)))}) + "\n")


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_docs")
    short_documents(out / "docs.jsonl")
    data = ["data=datasets", f"data.path={out / 'docs.jsonl'}"]
    assert compose([*BASE, *data, "model=llama-tiny"]).data.masks_documents  # the default for packed datasets
    train_spawned(compose, out, [*BASE, *data, "model=llama-tiny", "parallel.cp=2", "pipeline.degree=2"], CASES, 4)
    return out, reference(compose, "llama-tiny", out / "reference", tuple(data))


@pytest.mark.parametrize("name", list(CASES))
def test_cp_with_document_masks_equals_one_process(runs, name):
    out, ref = runs
    assert_ranks_equal(out, name, ref, 4)
