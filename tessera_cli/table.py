"""Columns as kubectl prints them: upper-case headers, left-aligned, three spaces apart.

Plain text (no rich): cheap to import, and what scripts and `grep` expect.
"""

from __future__ import annotations

from collections.abc import Sequence


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(headers), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        lines.append("   ".join(parts).rstrip())
    return "\n".join(lines)
