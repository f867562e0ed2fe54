"""Checkpoints across tensor-parallel degrees, on real gloo processes (pipetrain.launch).

A GPT-2 tiny run at tp=2 x pp=2 (fused c_attn split per head, tied wte / lm_head) saves at
steps 2 and 4. Resumed from step 2 at tp=1 x pp=2, at dp_shard=2 x pp=2 (FSDP2) and at tp=2
x pp=2 itself (the unsplit tensors sliced back into tp slices, AdamW moments too), steps 3-4
repeat the uninterrupted run's losses within 1e-4; the checkpoint holds every weight unsplit,
under the same keys and shapes a tp=1 run writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from pipetrain.launch import launch
from pipetrain.plan import make_plan
from pipetrain.train import checkpoint as ckpt
from pipetrain.train import checkpoint_dirs as dirs
from test_checkpoint import losses  # step -> loss from a run's metrics.jsonl

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, EVERY = 4, 2
BASE = ["mode=train", "model=gpt2-tiny", "data.batch_size=4", "data.seq_len=32", "pipeline.microbatches=4",
        f"trainer.max_steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=0", "trainer.device=cpu",
        "logger=[jsonl]", "pipeline.degree=2"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp1": [],
           "shard2": ["parallel.dp_shard=2", "pipeline.microbatches=2"]}  # 2 pipelines x 2 microbatches of 1


def train(compose, run_dir: Path, layout: str, *extra: str) -> Path:
    config = compose([*BASE, *LAYOUTS[layout], *extra])
    launch(config, make_plan(config), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def reference(compose, tmp_path_factory) -> Path:
    return train(compose, tmp_path_factory.mktemp("tp-reference"), "tp2", f"trainer.ckpt_every={EVERY}")


@pytest.mark.parametrize("layout", ["tp1", "shard2", "tp2"])
def test_tp_checkpoint_resumes_at_other_degrees_within_1e4(compose, reference, tmp_path, layout):
    run = train(compose, tmp_path / "run", layout, f"trainer.resume={dirs.step_dir(reference, EVERY)}")
    ref, got = losses(reference), losses(run)
    assert sorted(got) == [3, 4]
    for s in got:
        assert abs(got[s] - ref[s]) < 1e-4, (s, got[s], ref[s])
    if layout == "tp1":  # the same keys and unsplit shapes, whatever the tp degree that wrote them
        def shapes(path: Path) -> dict:
            md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            return {k: tuple(v.size) for k, v in md.items() if not k.startswith("rng.")}

        assert shapes(dirs.step_dir(run, STEPS)) == shapes(dirs.step_dir(reference, STEPS))


def test_only_tp_rank_0_writes_the_unsplit_weights(reference):
    """tp ranks gather each split weight and its AdamW moments to tp rank 0, which alone writes them, so
    no other tp rank ever holds the unsplit tensor (the step count is a scalar every rank offers).
    pp=2 x tp=2, tp innermost: global ranks 0 and 2 are tp rank 0, and every split key's bytes lie in
    their files (DCP names them __<rank>_<n>.distcp)."""
    md = dcp.FileSystemReader(dirs.step_dir(reference, STEPS)).read_metadata()
    split = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    writers = {(idx.fqn, info.relative_path.split("_")[2]) for idx, info in md.storage_data.items()
               if idx.fqn.endswith(split) and idx.fqn.startswith(("model.", "optim.exp_avg", "optim.exp_avg_sq"))}
    assert writers and {int(rank) for _, rank in writers} <= {0, 2}, sorted(writers)
