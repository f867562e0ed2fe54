"""Printing a rich table so that no value is ever cut.

On a terminal rich fits a table to its width. Off a terminal (SLURM logs, `| tee`, `| cat`)
rich assumes 80 columns and cuts what does not fit (`dua…`, `3.22…`): there a table is printed
at its natural width, up to WIDE columns, and past that its cells fold onto more lines, never
truncated.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

WIDE = 160  # the widest line a table gets off a terminal before its cells fold


def print_table(console: Console, table: Table) -> None:
    """console.print(table), never cutting a value (module docstring)."""
    if console.is_terminal:
        console.print(table)
        return
    for column in table.columns:  # fold what still does not fit, rather than an ellipsis
        column.no_wrap = False
        column.overflow = "fold"
    natural = Measurement.get(console, console.options.update(width=WIDE), table).maximum
    width = console.width
    console.width = max(width, min(natural, WIDE))  # print's own width= is capped at the console's
    try:
        console.print(table)
    finally:
        console.width = width
