"""dp x tp x pp on one 4-D mesh, 8 real gloo ranks: equal to one process.

dp_shard=2 x tp=2 x pp=2 (FSDP2 shards of tp slices) on llama-tiny under 1f1b, and
dp_replicate=2 x tp=2 x pp=2 (bucketed all-reduce of tp slices) on GPT-2 tiny under dualpipev
with sequence parallel: losses of steps 1-3 within 1e-6 of a single process (pipeline.degree=1)
on the same global batches, parameters after 3 clipped AdamW steps as test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from pipetrain.plan import make_plan
from test_tensor_parallel import BASE, assert_equal_training, reference, train_cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CASES = {"llama-tiny-shard": ["model=llama-tiny", "parallel.dp_shard=2", "schedule=1f1b"],
         "gpt2-tiny-replicate-sp": ["model=gpt2-tiny", "parallel.dp_replicate=2", "schedule=dualpipev",
                                    "parallel.sequence_parallel=true"]}


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp3d")
    cases = []
    for name, extra in CASES.items():
        config = compose([*BASE, "pipeline.degree=2", "parallel.tp=2", *extra])
        assert config.layout.world == 8
        cases.append((name, config, make_plan(config)))
    spawn(train_cases, 8, out, cases)
    models = {extra[0].split("=")[1] for extra in CASES.values()}
    return out, {m: reference(compose, m, out / f"reference-{m}") for m in models}


@pytest.mark.parametrize("name", list(CASES))
def test_dp_tp_pp_equals_one_process(runs, name):
    out, refs = runs
    ref = refs[CASES[name][0].split("=")[1]]
    names = set()
    for r in range(8):
        got = torch.load(out / f"{name}.rank{r}.pt")
        assert_equal_training(got, ref)
        names |= set(got["params"])
    assert names == set(ref["params"])
