"""Where a run's wall time goes: `pytest --suite-timeline=FILE` (tests/conftest.py) has every
process of the run (each xdist worker, or the one process) append one JSON line per test to FILE:

    {"test": nodeid, "worker": "gw0", "queued": t, "started": t, "ended": t, "serial": bool}

(seconds since the epoch: `queued` when the worker took the test up, `started` once the run's
lock let it run, `ended` after its teardown). `python tests/suite_timeline.py FILE` summarises it:
each worker's span, busy time and time spent waiting for the lock (a `serial` test holds
everyone else), how long it idled after its last test, and the slowest modules.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TimelineWriter:
    path: Path
    worker: str

    @contextmanager
    def test(self, nodeid: str, serial: bool, held: Iterator[None]) -> Iterator[None]:
        """Around one test: `held` is the run's lock context (entered here, so the wait for
        it is measured)."""
        queued = time.time()
        with held:
            started = time.time()
            try:
                yield
            finally:
                line = json.dumps({"test": nodeid, "worker": self.worker, "queued": queued,
                                   "started": started, "ended": time.time(),
                                   "serial": serial})  # fmt: skip
                # One write of a short line with O_APPEND: workers' lines do not interleave.
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)


def summary(lines: list[dict]) -> str:
    if not lines:
        return "no tests recorded"
    start = min(r["queued"] for r in lines)
    end = max(r["ended"] for r in lines)
    out = [f"run: {end - start:.1f} s from the first test to the last test's end"]
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for r in lines:
        by_worker[r["worker"]].append(r)
    for worker, rows in sorted(by_worker.items()):
        busy = sum(r["ended"] - r["started"] for r in rows)
        waited = sum(r["started"] - r["queued"] for r in rows)
        last = max(r["ended"] for r in rows)
        out.append(f"{worker}: {len(rows)} tests, busy {busy:.1f} s, waited for the lock "
                   f"{waited:.1f} s, done {last - start:.1f} s in (idle {end - last:.1f} s "
                   "at the end)")  # fmt: skip
    modules: dict[str, list[dict]] = defaultdict(list)
    for r in lines:
        modules[r["test"].split("::", 1)[0]].append(r)
    spans = sorted(
        ((max(r["ended"] for r in rows) - min(r["started"] for r in rows), module,
          rows[0]["worker"]) for module, rows in modules.items()),
        reverse=True,
    )  # fmt: skip
    out.append("slowest modules (first start to last end, lock waits included):")
    out += [f"  {span:7.1f} s  {worker}  {module}" for span, module, worker in spans[:30]]
    serial = [r for r in lines if r["serial"]]
    if serial:
        held = sum(r["ended"] - r["started"] for r in serial)
        out.append(f"serial tests: {len(serial)}, {held:.1f} s with the run to themselves")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} TIMELINE.jsonl", file=sys.stderr)
        return 2
    text = Path(argv[1]).read_text()
    print(summary([json.loads(line) for line in text.splitlines() if line.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
