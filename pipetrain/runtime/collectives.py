"""The tap through which collectives inside an action reach a measured step's record.

Expert-parallel all-to-alls (runtime/ep_comm.py, and node mode's runtime/nodes.py A2ALog) and context
parallel's K/V traffic (parallel/cp.py) run deep inside a stage's forward and backward, where no
recorder is passed. While it measures a step, the StepRecorder (runtime/recorder.py) installs itself
here as the sink; each collective then takes marks on the recorder's clock (perf_counter on CPU,
CUDA events on GPU: runtime/clock.py) and reports

  (group "ep" | "cp", label as "a2a:dispatch" or "cp:ring", bytes (ep: the all-to-all's output,
   this rank's own rows included; cp: what arrived from the other ranks, as cp/kv_bytes counts),
   mark when it was issued, mark when this rank began to wait for it)

at the moment its wait returned; the recorder gives it to the action running (metrics/records.py
CollectiveEvent). A node-by-node stage can report each node's span the same way (`run_node`).

Unmeasured steps install nothing: the sink is None and a collective pays a check (~0.1 us). Not a
process group or any other state a collective needs: only where its timings go (the module global
is the whole point: the code that issues the collective has no recorder to hand).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch


class Sink(Protocol):
    def mark(self) -> int:
        """A timestamp now on the step's clock: its index."""

    def collective(self, group: str, label: str, nbytes: int, started: int, waited: int) -> None:
        """A collective issued at mark `started`, waited for from mark `waited`, arrived now."""

    def node(self, label: str, started: int) -> None:
        """A node of a node-by-node stage (runtime/nodes.py) ran from mark `started` to now."""


_sink: Optional[Sink] = None


def sink() -> Optional[Sink]:
    """Where this step's collectives report (None: an unmeasured step). None while torch.compile traces
    (trainer.compile): a read of the global would guard the graph on it and recompile at each switch
    between measured and unmeasured steps; a collective that breaks the graph runs eagerly and reports."""
    if torch.compiler.is_compiling():
        return None
    return _sink


def install(new: Optional[Sink]) -> None:
    """The recorder of the step being measured, or None (every step starts by setting one or the other)."""
    global _sink
    _sink = new


def blocking(group: str, label: str, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`run()`: a collective this rank waits for as it issues it (all of its time exposed); returns its output,
    whose bytes a measured step's record gets with the span."""
    tap = sink()
    if tap is None:
        return run()
    started = tap.mark()
    out = run()
    tap.collective(group, label, out.nbytes, started, started)
    return out


def run_node(run: Callable[[], None], name: str, layer: str, microbatch: int, side: str) -> None:
    """`run()`, one node of a node-by-node stage (runtime/nodes.py); in a measured step its span goes to
    the record as "<name> L<layer> mb<microbatch> <side>" (the Chrome trace's row "rank r nodes")."""
    tap = sink()
    if tap is None:
        run()
        return
    started = tap.mark()
    run()
    tap.node(f"{name} L{layer} mb{microbatch} {side}", started)
