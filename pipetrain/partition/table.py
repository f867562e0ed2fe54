"""The partition table every run prints: stage, layers, params, estimated cost, imbalance.

Pure Python plus rich (no torch). Numbers are short (38.6M, 1.23) so the table fits an
80-column terminal; only the layer-name column may wrap, and nothing is cut with "…".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from rich import box
from rich.table import Table

from pipetrain.partition.costs import LayerCost
from pipetrain.partition.partition import Partition, imbalance

_NUMBERED = re.compile(r"^(.*?)(\d+)$")
_WHAT = {"layers": "layer count", "params": "params", "flops": "FLOPs/token", "time": "time f+b+w"}


def compact_names(names: Sequence[str]) -> str:
    """Runs of consecutively numbered names collapse: embed, h.0, h.1, h.2 -> "embed, h.0-2".

    The prefix is written once ("transformer.h.9-10", not "transformer.h.9-transformer.h.10")
    so a run stays one short word that the 80-column table never has to break."""
    groups: list[list[str]] = []  # runs of names
    last: tuple[str, int] | None = None  # (prefix, number) of the previous name, if numbered
    for name in names:
        m = _NUMBERED.match(name)
        key = (m.group(1), int(m.group(2))) if m else None
        if key and last and groups and key == (last[0], last[1] + 1):
            groups[-1].append(name)
        else:
            groups.append([name])
        last = key
    return ", ".join(g[0] if len(g) == 1 else f"{g[0]}-{_NUMBERED.match(g[-1]).group(2)}" for g in groups)


def human(x: float) -> str:
    """3-4 significant characters with an SI suffix: 38597376 -> 38.6M, 0.5 -> 0.5."""
    if x == 0:
        return "0"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= 0.9995 * div:
            return f"{x / div:.1f}{unit}" if abs(x) < 99.95 * div else f"{x / div:.0f}{unit}"
    return str(x) if isinstance(x, int) else f"{x:.3g}"


def _ms(x: float) -> str:
    return f"{x:.2f}" if x < 1e4 else f"{x:.0f}"


def _imbalance(values: Sequence[float]) -> str:
    return f"{100 * imbalance(values):.1f}%" if any(values) else "-"  # all zero: nothing to compare


def partition_table(
    plan: Partition, layers: Sequence[LayerCost] | None = None, *, title: str | None = None
) -> Table:
    """One row per stage, then the imbalance (max/mean - 1) of every cost column.

    `layers` re-costs the plan's cut with other per-layer numbers (e.g. measured times for a
    cut made from FLOPs); it must be the same layers, in order. Default: the plan's own.
    """
    if layers is not None:
        names = [layer.name for layer in layers]
        if names != [layer.name for layer in plan.layers]:
            raise ValueError(
                f"partition_table got {len(names)} layers that are not the plan's {plan.num_layers}: "
                "re-cost a plan only with the same model's layers"
            )
        plan = replace(plan, layers=tuple(layers))
    params, flops, ms = plan.chunk_params(), plan.chunk_flops(), plan.chunk_time_ms()
    show_flops = any(flops)
    mean_ms = sum(ms) / len(ms)

    table = Table(
        title=title or f"partition={plan.strategy}: {plan.num_layers} layers in {plan.num_chunks} stages",
        caption=f"balanced on {_WHAT[plan.balanced_on]}; imbalance = max/mean - 1",
        box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
    )
    table.add_column("stage", justify="right", no_wrap=True)
    table.add_column("idx", justify="right", no_wrap=True)
    table.add_column("layers", justify="left", overflow="fold", ratio=1)
    table.add_column("params", justify="right", no_wrap=True)
    if show_flops:
        table.add_column("FLOPs\n/token", justify="right", no_wrap=True)
    table.add_column("est. ms\nf+b+w", justify="right", no_wrap=True)
    table.add_column("vs\nmean", justify="right", no_wrap=True)
    for c, rng in enumerate(plan.bounds):
        idx = str(rng.start) if len(rng) == 1 else f"{rng.start}-{rng.stop - 1}"
        vs = f"{100 * (ms[c] / mean_ms - 1):+.1f}%" if mean_ms > 0 else "-"
        row = [str(c), idx, compact_names(plan.layer_names(c)), human(params[c])]
        row += [human(flops[c])] if show_flops else []
        table.add_row(*row, _ms(ms[c]), vs)
    table.add_section()
    row = ["", "", "imbalance", _imbalance(params)]
    row += [_imbalance(flops)] if show_flops else []
    table.add_row(*row, _imbalance(ms), "")
    return table
