"""The one rich console every `tabrl` command prints with, and how it prints tables.

Output that a person or a script reads must not depend on the terminal's width: text is printed
without soft wrapping (a long path or snapshot name stays on one line, greppable whole), and a
table is rendered at its own natural width instead of being squeezed (cells cut with "…") to fit
a narrow terminal. Tables here are a few short columns, so they fit 80 columns as they are.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

console = Console(soft_wrap=True)


def print_table(table: Table) -> None:
    """Print a table at its natural width (title included), whatever the terminal's width."""
    wide = console.options.update(width=10_000, max_width=10_000)
    width = Measurement.get(console, wide, table).maximum
    title = len(str(table.title)) if table.title else 0
    table.width = max(width, title)  # the table's own width wins over the terminal's
    console.print(table, crop=False)
