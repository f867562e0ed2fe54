"""A dead or stuck peer never hangs the job: every rank fails with a clear error in time."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from _dist import spawn
from pipetrain.models.factory import build_model
from pipetrain.parallel.layout import Layout
from pipetrain.parallel.mesh import build_groups
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.train.pipeline import Transport, build_rank_pipeline
from pipetrain.schedules import registry

pytestmark = pytest.mark.dist

TIMEOUT_S = 3.0


def die_mid_step(rank: int, world: int, out, victim: int, how: str) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", n_layer=8)
    sched = registry.build("1f1b", world, 8, 1)
    rp = build_rank_pipeline(model, uniform_bounds(8, world), sched, rank, microbatch_size=2,
                             transport=Transport(timeout_s=TIMEOUT_S))
    g = torch.Generator().manual_seed(0)
    mbs = [model.example_batch(microbatch=2, seq=1, generator=g) for _ in range(8)]
    rp.train_step(mbs)  # one healthy step first
    if rank == victim:
        calls = {"n": 0}

        def hook(module, inputs):
            calls["n"] += 1
            if calls["n"] == 3:  # mid-step, after some messages went out
                if how == "kill":
                    (out / "victim_died.txt").write_text(repr(time.time()))
                    os._exit(17)
                # stuck: alive but silent for longer than the timeout, until every other rank
                # has reported (at most 4 x the timeout), then gone without a word
                others = [out / f"error{r}.txt" for r in range(world) if r != rank]
                deadline = time.monotonic() + 4 * TIMEOUT_S
                while time.monotonic() < deadline and not all(p.exists() for p in others):
                    time.sleep(0.1)
                os._exit(0)

        next(iter(rp.stages.values())).register_forward_pre_hook(hook)
    rp.train_step(mbs)


def run(tmp_path, how: str):
    world, victim = 3, 1
    t0 = time.monotonic()
    ctx = spawn(die_mid_step, world, tmp_path, victim, how, join=False)
    for p in ctx.processes:
        p.join(timeout=60)
    elapsed = time.monotonic() - t0
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    return elapsed, codes, victim


def check_survivors(tmp_path, codes, victim):
    for r, code in enumerate(codes):
        if r == victim:
            continue
        assert code not in (0, None), f"rank {r} did not fail (exit code {code})"
        err = (tmp_path / f"error{r}.txt").read_text().splitlines()[0]
        assert err.startswith("P2PError: rank "), err
        assert f"rank {r}:" in err  # names itself
        assert re.search(r"\d+(F|B|W|BW)\d+ on rank", err), err  # names the action it was running
        # names the peer it waited for (the victim, or a rank that failed because of it)
        assert "from rank" in err or "for rank" in err, err


def test_killed_rank_makes_every_rank_exit_with_a_clear_error(tmp_path):
    elapsed, codes, victim = run(tmp_path, "kill")
    assert codes[victim] == 17
    check_survivors(tmp_path, codes, victim)
    # In time: from the kill to the last survivor's error, a few timeouts at most (a rank may wait
    # on a peer that is itself waiting on the dead one). Measured from the kill, not from the
    # start, so a loaded machine's slow start-up (the run's `elapsed`) does not count; a hang would
    # hit the 60 s join limit.
    died = float((tmp_path / "victim_died.txt").read_text())
    detected = max((tmp_path / f"error{r}.txt").stat().st_mtime for r in range(3) if r != victim)
    assert detected - died < 4 * TIMEOUT_S, (detected - died, elapsed)


@pytest.mark.slow  # the survivors wait out the timeout
def test_stuck_rank_times_out_with_the_knob_named(tmp_path):
    elapsed, codes, victim = run(tmp_path, "stuck")
    check_survivors(tmp_path, codes, victim)
    errs = [(tmp_path / f"error{r}.txt").read_text() for r in range(3) if r != victim]
    assert any("pipeline.p2p_timeout_s" in e for e in errs)


def die_under_dp(rank: int, world: int, out, victim: int) -> None:
    """pp=2 x dp_replicate=2: global ranks 0, 2 are one pipeline and 1, 3 the other, so pipeline
    index 0 is global rank 0 or 1."""
    layout = Layout(pp=2, dp_replicate=2)
    groups = build_groups(layout, "cpu")
    torch.manual_seed(0)
    model = build_model("mlp", n_layer=8)
    sched = registry.build("1f1b", 2, 8, 1)
    rp = build_rank_pipeline(model, uniform_bounds(8, 2), sched, groups.pp_rank, microbatch_size=2,
                             transport=Transport(timeout_s=TIMEOUT_S, group=groups.pp_group,
                                                 group_ranks=groups.pipeline_ranks, pipelines=layout.pipelines()))
    rp.executor.comm.name_ranks(layout)  # as the Trainer does
    g = torch.Generator().manual_seed(0)
    mbs = [model.example_batch(microbatch=2, seq=1, generator=g) for _ in range(8)]
    if rank == victim:
        os._exit(17)  # before its first activation goes out
    rp.train_step(mbs)


def test_under_data_parallel_errors_name_global_ranks_and_coordinates(tmp_path):
    """A pipeline index alone ("rank 0") is global rank 0 or 1 here: the error names global rank 1,
    which died, with its pp / dp coordinates, and the rank that saw it."""
    ctx = spawn(die_under_dp, 4, tmp_path, 1, join=False)
    try:
        ctx.processes[3].join(timeout=60)  # rank 1's pipeline peer; ranks 0 and 2 wait in the loss all-reduce
        err = (tmp_path / "error3.txt").read_text().splitlines()[0]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert err.startswith("P2PError: rank 3 (pp 1, dp_replicate 1): 1F0 on rank 3 waiting for the activation of "
                          "0F0 from rank 1 (pp 0, dp_replicate 1) "), err
    assert "rank 0" not in err, err
