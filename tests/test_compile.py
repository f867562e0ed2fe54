"""trainer.compile=true on real gloo processes: every layer of every stage compiled with
torch.compile (in place, names unchanged), llama-tiny. At P=2 three runs in one process group: tp=2
(the TP collectives inside compiled blocks), that under selective recompute (trainer.recompute=selective:
the recomputed calls eager between compiled graphs), and pp=2 under ZB-V; at P=4 ZB-V alone. A compiled stage
keeps ZB-V's B and W apart (parallel/parallelize.py apply_compile: its matrix-weight modules run eager,
so W holds their weight-gradient GEMMs; runtime/backward.py), the first step's receives waiting out the
peer's compilation (trainer.compile_timeout_s). The losses of steps 1-3 equal the eager single process
within 1e-4, and the weights after 3 steps likewise; the measured actions of the last step (what the
trace and the timeline draw) are the schedule's as its schedule.csv writes them: F, B and W. Slow: CPU
compilation takes tens of seconds per rank here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import spawn
from _parity import full_tensors
from pipetrain.plan import make_plan
from pipetrain.schedules.ir import Schedule
from test_tensor_parallel import BASE, STEPS, reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def blocks(ranks: int) -> tuple[str, ...]:
    """Just enough blocks for ZB-V's 2P stages (embed and head one layer each): every compiled graph
    (embedding, block, head; forward and backward) still compiles, and compilation is this test's time."""
    return (f"model.num_hidden_layers={2 * ranks - 2}",)


def train_measured(rank: int, world: int, out: Path, cases: list) -> None:
    """test_tensor_parallel.train_cases, the last step measured: rank 0 keeps every rank's measured actions."""
    from pipetrain.train.trainer import Trainer

    for name, config, plan in cases:
        trainer = Trainer(config, plan, out / name)
        records = [trainer.train_step(measure=i == STEPS - 1) for i in range(STEPS)]
        measured = records[-1].measurement
        torch.save({"losses": [r.loss for r in records], "params": full_tensors(trainer),
                    "measured": measured and [[t.step for t in s.timings] for s in measured.samples]},
                   out / f"{name}.rank{rank}.pt")


def check_against_eager(compose, tmp_path: Path, cases: dict[str, list[str]], ranks: int) -> dict:
    """Runs `cases` compiled on `ranks` processes; each rank's losses and weights against the eager
    single process. Returns the plans."""
    layers = blocks(ranks)
    configs = {name: compose([*BASE, "model=llama-tiny", *layers, "trainer.compile=true", *extra])
               for name, extra in cases.items()}
    plans = {name: make_plan(c) for name, c in configs.items()}
    spawn(train_measured, ranks, tmp_path, [(name, c, plans[name]) for name, c in configs.items()])
    ref = reference(compose, "llama-tiny", tmp_path / "eager", layers)
    for name, rank in [(name, rank) for name in cases for rank in range(ranks)]:
        got = torch.load(tmp_path / f"{name}.rank{rank}.pt")
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-4, (got["losses"], ref["losses"])
        assert got["params"]
        for pname, t in got["params"].items():
            torch.testing.assert_close(t, ref["params"][pname], rtol=0, atol=1e-4, msg=pname)
    return plans


def check_zbv_trace(tmp_path: Path, zbv: Schedule) -> None:
    """The last step's measured actions are ZB-V's as schedule.csv writes them: F, B and W."""
    written = Schedule.from_csv(zbv.to_csv(), name="zbv", placement=zbv.placement,
                                num_microbatches=zbv.num_microbatches)
    measured = torch.load(tmp_path / "zbv.rank0.pt")["measured"]
    assert measured == [[str(step) for step in written.steps[r]] for r in range(zbv.num_ranks)]
    ops = {a.op.value for r in range(zbv.num_ranks) for a in written.actions(r)}
    assert ops == {"F", "B", "W"}, ops


def test_compiled_stages_train_as_eager(compose, tmp_path: Path):
    cases = {"tp2": ["pipeline.degree=1", "parallel.tp=2", "schedule=1f1b"],
             # a short P2P timeout: the first step's receives wait for the peer's compilation (many
             # seconds), which trainer.compile_timeout_s covers; steps 2-3 run under the 5 s
             "zbv": ["pipeline.degree=2", "schedule=zbv", "pipeline.p2p_timeout_s=5"],
             # selective recompute under compile: the recomputed calls run eager between compiled graphs
             "tp2-selective": ["pipeline.degree=1", "parallel.tp=2", "schedule=1f1b", "trainer.recompute=selective"]}
    plans = check_against_eager(compose, tmp_path, cases, 2)
    check_zbv_trace(tmp_path, plans["zbv"].schedule)


def test_compiled_zbv_at_four_ranks_keeps_b_and_w(compose, tmp_path: Path):
    cases = {"zbv": ["pipeline.degree=4", "schedule=zbv", "pipeline.p2p_timeout_s=20"]}
    plans = check_against_eager(compose, tmp_path, cases, 4)
    check_zbv_trace(tmp_path, plans["zbv"].schedule)
