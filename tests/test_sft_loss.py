"""The global-batch loss (issue 46): the mean over the loss tokens of the whole global batch, so the gradient
is the same at any pipeline.microbatches, dp or pp degree, on data=sft rows whose microbatches count
uneven loss tokens (runtime/step_loss.py). Real chats, a real chat tokenizer and a tiny Llama written by
transformers (tests/_chat.py); dp and pp runs are real gloo processes; gradients within the suite's error
model (tests/_parity.py). Where every microbatch counts the same, nothing changes: the seeds are 1/M."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _chat import chat_model, chats, write_jsonl
from _dist import spawn
from _parity import assert_gradients_close, full_tensors

from pipetrain.plan import make_plan

pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")

STEPS = 2


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-loss")
    os.environ["HF_DATASETS_CACHE"] = str(root / "cache")  # inherited by the spawned ranks
    folder = chat_model(root / "tiny-chat-llama")
    path = write_jsonl(root / "chat.jsonl", chats(120))
    base = ["mode=train", "model=llama-tiny", f"model.pretrained={folder}", "data=sft", f"data.path={path}",
            "data.batch_size=8", "data.seq_len=96", "trainer.device=cpu", "logger=[jsonl]", "trainer.eval_every=0",
            "optim.warmup_steps=0", "optim.eps=1e-6", "optim.lr=1e-3"]
    return root, base


def gradients(config, run_dir: Path) -> dict:
    from pipetrain.train.trainer import Trainer

    trainer = Trainer(config, make_plan(config), run_dir)
    losses, grads, weighted = [], [], []
    for _ in range(STEPS):
        losses.append(trainer.train_step().loss)
        weighted.append(trainer.input.tokens is not None)
        grads.append(full_tensors(trainer, grads=True))
    return {"losses": losses, "grads": grads, "weighted": weighted}


@pytest.mark.pure
def test_microbatches_1_and_4_give_the_same_gradient(sft, compose):
    root, base = sft
    one = gradients(compose([*base, "pipeline.degree=1", "pipeline.microbatches=1"]), root / "m1")
    four = gradients(compose([*base, "pipeline.degree=1", "pipeline.microbatches=4"]), root / "m4")
    assert all(four["weighted"]) and not any(one["weighted"])  # uneven loss tokens per microbatch
    assert_gradients_close(four["grads"], one["grads"], what="M=4 vs M=1")
    assert max(abs(a - b) for a, b in zip(four["losses"], one["losses"])) < 1e-5


@pytest.mark.pure
def test_equal_counts_keep_the_seeds_at_one_over_m():
    from pipetrain.parallel.parallelize import Parallelize
    from pipetrain.runtime.step_loss import GlobalTokens, StepLoss

    y = torch.arange(8 * 6).reshape(8, 6)
    assert Parallelize(rows=(0, 2)).global_tokens((y, y), 2) is None  # packed: every target counts
    y[0, :3] = -1
    assert Parallelize(rows=(0, 2)).global_tokens((y, y), 2) == GlobalTokens(45, 2)
    loss = StepLoss(torch.device("cpu"), None, num_microbatches=4)
    ones = loss.seed(torch.zeros(()))
    targets = [torch.tensor([1] * 12), torch.tensor([1] * 6 + [-1] * 6), torch.tensor([-1] * 12)]
    loss.reset(GlobalTokens(count=96, ranks=2), targets)  # 12 a microbatch on average
    assert loss.seed(torch.zeros(()), 0) is ones  # exactly 1/M: the very tensor as before
    assert float(loss.seed(torch.zeros(()), 1)) == 0.125 and float(loss.seed(torch.zeros(()), 2)) == 0


def train_cases(rank: int, world: int, out: Path, cases: list) -> None:
    for name, config in cases:
        torch.save(gradients(config, out / name), out / f"{name}.rank{rank}.pt")


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_and_pp2_give_the_gradient_of_one_process(sft, compose):
    root, base = sft
    ref = gradients(compose([*base, "pipeline.degree=1", "pipeline.microbatches=1"]), root / "ref")
    cases = [("dp2", compose([*base, "pipeline.degree=1", "parallel.dp_replicate=2", "pipeline.microbatches=2"])),
             ("pp2", compose([*base, "pipeline.degree=2", "pipeline.microbatches=4"]))]
    spawn(train_cases, 2, root, cases)
    for name, _ in cases:
        for rank in range(2):
            got = torch.load(root / f"{name}.rank{rank}.pt")
            assert all(got["weighted"]), name
            assert_gradients_close(got["grads"], ref["grads"], what=f"{name} rank {rank}")
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-5, (name, got["losses"])
