"""How the schedule checks and the simulator scale with the number of ranks: work counted, never timed.

`mode=simulate` at P=10^4, M=64 took 309 s (issue 25) because the P2P checker's rule (2) looked at
every pair of ranks, P^2/2 of them, where only neighbours exchange messages. The numbers behind
"linear in P and M" are in bench/results/simulate_large.json (bench/simulate_large.py)."""

from __future__ import annotations

import gc
import io

import pytest
from rich.console import Console

from pipetrain.schedules import registry, render
from pipetrain.schedules.gc_pause import gc_paused, without_gc
from pipetrain.schedules.p2p import build_plans
from pipetrain.schedules.p2p_check import _check_pair_order, _positions
from pipetrain.schedules.simulate import simulate

pytestmark = pytest.mark.pure


class _CountingDict(dict):
    """A rank's (peer, is_send) -> messages map that counts the look-ups the checker makes."""

    gets = 0

    def get(self, *args):
        _CountingDict.gets += 1
        return super().get(*args)


@pytest.mark.parametrize("name,P,M,v", [("1f1b", 300, 2, 1), ("interleaved_1f1b", 60, 60, 2), ("zbv", 100, 2, 2)])
def test_pair_order_looks_only_at_pairs_that_exchange_messages(name, P, M, v):
    sched = registry.build(name, P, M, v)
    pos = [_CountingDict(_positions(p)) for p in build_plans(sched)]
    _CountingDict.gets = 0
    _check_pair_order(pos)
    # A rank talks to its two neighbours (a V or a loop adds one more pair): a few look-ups per
    # rank, not the 4 per pair of ranks (2P(P - 1)) the check made before.
    assert _CountingDict.gets <= 4 * 2 * P


def test_gc_paused_restores_the_collector_and_nests():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one leaves it to the outer
    assert gc.isenabled()
    gc.disable()
    try:
        without_gc(lambda: None)()
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


@pytest.mark.parametrize("name,P,M,v", [("interleaved_1f1b", 4, 8, 2), ("dualpipe", 4, 10, 2), ("1f1b", 40, 16, 1)])
@pytest.mark.parametrize("terminal", [False, True])
def test_timeline_prints_what_its_lines_say(name, P, M, v, terminal):
    """The timeline hands rich its rows as segments (no wrapping of 10^5 lines): the console shows
    exactly what printing each line of `timeline_lines` shows, colours and wrapped legend included."""
    res = simulate(registry.build(name, P, M, v))

    def console():
        return Console(file=io.StringIO(), width=60, force_terminal=terminal,
                       color_system="truecolor" if terminal else None)

    fast, slow = console(), console()
    fast.print(render.render_timeline(res, width=60))
    for line in render.timeline_lines(res, 60, plain=not terminal):  # off a terminal: labels that read alone
        slow.print(line)
    assert fast.file.getvalue() == slow.file.getvalue()


def test_a_tall_timeline_takes_fewer_bands():
    """Ranks x bands stay under render.MAX_LINES: at P=10^4, 12 bands of every rank were 120,000 lines."""
    P = 300
    res = simulate(registry.build("1f1b", P, 8, 1))
    lines = [line.plain for line in render.timeline_lines(res, 80)]
    assert sum(line.lstrip().startswith("rank ") for line in lines) <= render.MAX_LINES
    assert len(render.timeline_lines(simulate(registry.build("1f1b", 4, 64, 1)), 80)) > 4 * 2  # short ones still wrap


def test_simulate_prints_no_table_of_thousands_of_stages(tmp_path):
    from pipetrain.compose import compose_config
    from pipetrain.simulate_cmd import MAX_TABLE_ROWS, plan_and_simulate

    P = MAX_TABLE_ROWS + 1
    config = compose_config(["mode=simulate", "model=sleep", f"model.layers={P}", f"pipeline.degree={P}",
                             "pipeline.microbatches=2", "sim.timeline=false"])
    console = Console(file=io.StringIO(), width=100)
    _, record = plan_and_simulate(config, tmp_path, console, timeline=False, write=False)
    out = console.file.getvalue()
    assert f"no table past {MAX_TABLE_ROWS} stages (simulate.json lists all {P})" in " ".join(out.split())
    assert len(out.splitlines()) < 40 and len(record["partition"]["est_ms"]) == P
