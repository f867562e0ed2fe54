"""The rank table `mode=simulate` and a training run's first lines print under data parallel:
global rank -> (pp, dp_replicate, dp_shard) -> the stages it holds, and the ranks it reduces with.

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
    for name in ("rank", "pp", "dp_replicate", "dp_shard", "stages", "reduces with\nranks"):
        table.add_column(name, justify="left" if name.startswith("reduces") else "right", no_wrap=True)
    for rank, c, stages in rank_rows(layout, stages_of):
        table.add_row(str(rank), str(c.pp), str(c.dp_replicate), str(c.dp_shard), "|".join(map(str, stages)),
                      ",".join(str(r) for r in layout.dp_ranks(rank)))
    return table
