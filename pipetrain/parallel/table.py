"""The rank table `mode=simulate` and a training run's first lines print under data parallel:
global rank -> (pp, dp_replicate, dp_shard[, cp][, tp]) -> the stages it holds, the ranks it reduces with
(and, under tensor parallel, the ranks it splits its layers with).

Pure Python plus rich (no torch), like the partition table (partition/table.py).
"""

from __future__ import annotations

from typing import Sequence

from rich import box
from rich.table import Table

from pipetrain.parallel.layout import Layout, rank_rows


def rank_table(layout: Layout, stages_of: Sequence[Sequence[int]]) -> Table:
    """One row per global rank; `stages_of[p]`: the placement's stages of pipeline rank p."""
    title = f"ranks of {layout.describe()}"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.min_width = len(title)  # the title on one line above a narrow table
    tp, cp = layout.tp > 1, layout.cp > 1
    names = ("rank", "pp", "dp_replicate", "dp_shard", *(("cp",) if cp else ()), *(("tp",) if tp else ()), "stages",
             "reduces with\nranks", *(("splits layers\nwith ranks",) if tp else ()))
    for name in names:
        table.add_column(name, justify="left" if "ranks" in name else "right", no_wrap=True)
    for rank, c, stages in rank_rows(layout, stages_of):
        cells = [str(rank), str(c.pp), str(c.dp_replicate), str(c.dp_shard), *([str(c.cp)] if cp else []),
                 *([str(c.tp)] if tp else []), "|".join(map(str, stages)),
                 ",".join(str(r) for r in layout.dp_ranks(rank))]
        cells += [",".join(str(r) for r in layout.tp_ranks(rank))] if tp else []
        table.add_row(*cells)
    return table
