"""Record benchmark figures in bench/RESULTS.md, one section per benchmark.

    from record import record_section
    record_section("scheduler", markdown_text)

Only the named section (between its markers) is replaced, so benchmarks never clobber each other.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = (
    "# Benchmark results\n\nRecorded by `make bench` (each script rewrites only its section).\n"
)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def record_section(name: str, markdown: str) -> None:
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    block = f"{begin}\n## {name}\n\n_{stamp}, {machine()}_\n\n{markdown.strip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
