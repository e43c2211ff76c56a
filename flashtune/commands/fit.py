"""Tables that fit the terminal without cutting a cell.

A rich table squeezed below its natural width folds or ellipsizes its cells, and a bucket
key, a config key or an error text cut in the middle is worse than useless. ``print_rows``
prints a table whose every cell is whole:

- when the table's natural width fits the console, as one table (no cell wraps);
- otherwise as one block of ``column  value`` lines per row, which fits any width (a value
  wider than the terminal is printed in one piece, for the terminal to wrap).

Long free text (error messages) never sits in a table cell: the cell holds a reference
``[n]`` and the texts are printed whole below the table, each once.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table()
    for column in columns:
        table.add_column(column, no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    return table


def print_rows(console: Console, title: str | None, columns: Sequence[str],
               rows: Sequence[Sequence[str]], *, notes: Sequence[str] = ()) -> None:
    """Print ``rows`` (already printable text, one cell per column) under ``title``; the
    columns named in ``notes`` hold free text printed whole below a table (the module
    docstring)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells ({', '.join(columns)})")
    note_columns = [i for i, name in enumerate(columns) if name in notes]
    texts: dict[str, int] = {}
    referenced = []
    for row in rows:
        cells = list(row)
        for i in note_columns:
            if cells[i]:
                cells[i] = f"[{texts.setdefault(cells[i], len(texts) + 1)}]"
        referenced.append(cells)
    table = _table(columns, referenced)
    natural = console.measure(table, options=console.options.update_width(1 << 20))
    if title:  # above the table, whole (a table's own title wraps to the table's width)
        console.print(Text(title), soft_wrap=True)
    if natural.maximum <= console.width:
        console.print(table)
        for text, number in texts.items():
            console.print(Text(f"[{number}] {text}"), soft_wrap=True)
        return
    width = max(map(len, columns), default=0)
    for number, row in enumerate(rows, 1):
        console.print(Text(f"{number}."), soft_wrap=True)
        for name, cell in zip(columns, row, strict=True):
            if cell:  # the lines of a multi-line value aligned under its first
                value = cell.replace("\n", "\n" + " " * (width + 4))
                console.print(Text(f"  {name:<{width}}  {value}"), soft_wrap=True)
