"""Rich tables on a terminal, plain aligned columns elsewhere.

Off a terminal (a pipe, a file, `watch`, CI logs) rich draws its boxes at 80 columns and wraps
every cell that does not fit. There the same table is printed as `tessera get` prints: upper-case
headers, left-aligned columns three spaces apart, one row per line, markup dropped.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .table import render


def _text(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)


def plain(table: Table) -> str:
    """The table as plain aligned columns, its title (if any) on the line above."""
    headers = [_text(c.header).upper() for c in table.columns]
    columns = [[_text(cell) for cell in c._cells] for c in table.columns]
    rows = [list(row) for row in zip(*columns, strict=True)] if columns else []
    body = render(headers, rows)
    title = _text(table.title) if table.title else ""
    return f"{title}\n{body}" if title else body


def show(console: Console, table: Table) -> None:
    """Print `table`: drawn by rich on a terminal, plain columns otherwise."""
    if console.is_terminal:
        console.print(table)
    else:
        print(plain(table), file=console.file, flush=True)
