"""Tensor parallel x pipeline on real gloo processes (4 ranks: tp=2 x pp=2): equal to one process.

llama-tiny (GQA: 4 query heads, 2 key/value heads, tied embedding and head) and GPT-2 tiny
(fused c_attn split per head, tied wte / lm_head), for 1f1b, zbv and dualpipev (DualPipe's
mirror: every chunk on two ranks of the same tp index), and sequence parallel on each model
once (GPT-2's with activation checkpointing): the losses of steps 1-3 equal a single process (pipeline.degree=1,
tp=1) training on the same batches within 1e-6 (the last stage's loss is the vocab-parallel cross-entropy:
no rank holds the whole logits), every step's reduced gradients within fp32's reassociation bound
(tests/_parity.py: per tensor, tau_k x (its norm + its share of the step's gradient), tau_k = 32 U,
256 U, 4096 U at steps 1-3), and the parameters after 3 AdamW steps (tp slices gathered) within 1e-6
(measured: losses 3.6e-7, parameters 3.4e-7 on 2 CPU cores; BASE says why optim.eps is 1e-6). The
gradients are compared, not only the weights: AdamW's update m / sqrt(v) hides a gradient scaled by
a constant. The clipped steps (optim.grad_clip=0.05 clips every step here) check the gradient norm
over tp-sharded and tp-replicated weights: a norm off by a factor would move every weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import spawn
from _parity import assert_gradients_close, full_tensors
from pipetrain.plan import make_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
BASE = ["mode=train", "data.batch_size=8", "data.seq_len=16", "pipeline.microbatches=4", "trainer.device=cpu",
        "logger=[jsonl]", "trainer.eval_every=0", "optim.warmup_steps=0", "optim.grad_clip=0.05",
        "trainer.ckpt_at_end=false", "optim.eps=1e-6"]
# optim.eps=1e-6: AdamW's first steps move every weight by ~lr whatever the size of its gradient,
# so a gradient element that is ~0 turns float-summation noise (TP sums partial products in
# another order than one process does) into lr-sized steps; eps 1e-6 keeps those elements still
# while every gradient that matters (> 1e-5) steps as before.
MODELS = ("llama-tiny", "gpt2-tiny")
SCHEDULES = ("1f1b", "zbv", "dualpipev")
CASES = [(m, s, False) for m in MODELS for s in SCHEDULES] + [("llama-tiny", "1f1b", True), ("gpt2-tiny", "zbv", True)]
# extra knobs per case: activation checkpointing recomputes forwards (and their TP collectives)
# inside B and W
EXTRA = {("gpt2-tiny", "zbv", True): ["trainer.activation_checkpointing=true"]}


def case_name(model: str, schedule: str, sp: bool) -> str:
    return f"{model}-{schedule}{'-sp' if sp else ''}"


def train_cases(rank: int, world: int, out: Path, cases: list) -> None:
    from pipetrain.train.trainer import Trainer

    for name, config, plan in cases:
        trainer = Trainer(config, plan, out / name)
        torch.save(train_recording(trainer), out / f"{name}.rank{rank}.pt")


def reference(compose, model: str, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    from pipetrain.train.trainer import Trainer

    config = compose([*BASE, f"model={model}", "pipeline.degree=1", *extra])
    return train_recording(Trainer(config, make_plan(config), run_dir))


def train_recording(trainer) -> dict:
    """STEPS optimizer steps: each step's loss, gradient norm and whole reduced gradients, then the weights."""
    losses, parts, norms, grads = [], [], [], []
    for _ in range(STEPS):
        record = trainer.train_step()
        losses.append(record.loss)
        parts.append(record.losses)  # the parts beside the loss: mtp/loss_k (models/mtp.py)
        norms.append(record.grad_norm)
        grads.append(full_tensors(trainer, grads=True))  # kept until the next step's zero_grad
    return {"losses": losses, "parts": parts, "norms": norms, "grads": grads, "params": full_tensors(trainer)}


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    cases = []
    for model, schedule, sp in CASES:
        extra = (["parallel.sequence_parallel=true"] if sp else []) + EXTRA.get((model, schedule, sp), [])
        config = compose([*BASE, f"model={model}", "pipeline.degree=2", "parallel.tp=2", f"schedule={schedule}",
                          *extra])
        cases.append((case_name(model, schedule, sp), config, make_plan(config)))
    spawn(train_cases, 4, out, cases)
    return out, {m: reference(compose, m, out / f"reference-{m}") for m in MODELS}


def assert_equal_training(got: dict, ref: dict) -> None:
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-6, (got["losses"], ref["losses"])
    assert [list(p) for p in got["parts"]] == [list(p) for p in ref["parts"]]
    for g, r in zip(got["parts"], ref["parts"]):
        assert max((abs(g[k] - r[k]) for k in r), default=0.0) < 1e-6, (got["parts"], ref["parts"])
    # step 1's gradient is exact; later norms read weights that already differ by float noise
    assert abs(got["norms"][0] / ref["norms"][0] - 1) < 1e-6, (got["norms"], ref["norms"])
    assert max(abs(a / b - 1) for a, b in zip(got["norms"], ref["norms"])) < 1e-4, (got["norms"], ref["norms"])
    assert_gradients_close(got["grads"], ref["grads"])
    assert set(got["params"]) <= set(ref["params"])
    for name, t in got["params"].items():
        torch.testing.assert_close(t, ref["params"][name], rtol=0, atol=1e-6, msg=name)


def assert_ranks_equal(out: Path, name: str, ref: dict, world: int) -> None:
    """Every rank of case `name` trained as `ref`, and together they hold every weight."""
    names = set()
    for r in range(world):
        got = torch.load(out / f"{name}.rank{r}.pt")
        assert_equal_training(got, ref)
        names |= set(got["params"])
    assert names == set(ref["params"])


def train_spawned(compose, out: Path, base: list[str], cases: dict[str, list[str]], world: int) -> None:
    """Every case (name -> its knobs on top of `base`) trained in one group of `world` gloo ranks."""
    built = []
    for name, extra in cases.items():
        config = compose([*base, *extra])
        assert config.layout.world == world, (name, config.layout.describe())
        built.append((name, config, make_plan(config)))
    spawn(train_cases, world, out, built)


def assert_resumes(compose, run_dir: Path, base: list[str], saved: list[str], resumed: list[str],
                   keys: tuple[str, ...] = ("train/loss",)) -> None:
    """Train 4 steps with `saved` knobs and a checkpoint at step 2, resume it for steps 3-4 with
    `resumed` knobs: the resumed losses (metrics `keys`) repeat the uninterrupted run's within 1e-4."""
    from pipetrain.launch import launch
    from pipetrain.train import checkpoint_dirs as dirs
    from test_checkpoint import losses

    base = [*base, "trainer.max_steps=4", "trainer.log_every=1"]
    first = compose([*base, *saved, "trainer.ckpt_every=2"])
    launch(first, make_plan(first), run_dir / "saved")
    second = compose([*base, *resumed, f"trainer.resume={dirs.step_dir(run_dir / 'saved', 2)}"])
    launch(second, make_plan(second), run_dir / "resumed")
    for key in keys:
        ref, got = losses(run_dir / "saved", key), losses(run_dir / "resumed", key)
        assert sorted(got) == [3, 4]
        for s in got:
            assert abs(got[s] - ref[s]) < 1e-4, (key, s, got[s], ref[s])


@pytest.mark.parametrize("model, schedule, sp", CASES)
def test_tp_pipelines_equal_one_process(runs, model, schedule, sp):
    out, refs = runs
    ranks = [torch.load(out / f"{case_name(model, schedule, sp)}.rank{r}.pt") for r in range(4)]
    names = set()
    for got in ranks:
        assert_equal_training(got, refs[model])
        names |= set(got["params"])
    assert names == set(refs[model]["params"])  # every weight is held somewhere
