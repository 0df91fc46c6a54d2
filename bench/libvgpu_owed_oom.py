"""The driver's OOM for memory a container is owed (issue 33, docs/elastic.md "Reclaim" steps 6
and 7): how long the program waits for its answer.

Real parts: libvgpu in a driver-API program (cuctl) on the fake driver, whose physical memory is
shared by every process (tests/native/conftest.py's Cluster); a hard slice guaranteed 8 GiB of
the 16 GiB card, limits sealed as the node agent seals them. Two cases, N runs each:

  * full: a process outside Tessera (no libvgpu) holds 12 GiB for good; the slice asks 8 GiB
    (owed: within its guarantee). Nothing is coming back: time to the CUDA OOM.
  * late: a process of the slice died holding its 8 GiB; the driver frees that memory 300 ms
    late (FAKE_EXIT_FREE_DELAY_MS); the next process asks 8 GiB. Memory is coming back: time
    to the grant.

The retry bound is the default (TESSERA_RECLAIM_RETRY_MS 1000 ms). Wall-clock figures (the
answer's latency is what a program sees), with the load average before and after.

    python bench/libvgpu_owed_oom.py [runs]          # -> bench/RESULTS.md "libvgpu-owed-oom"
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from record import record_section  # noqa: E402

from tessera import region  # noqa: E402
from tests.native.conftest import Cluster, NativeBuild, build_native  # noqa: E402

GiB = 1 << 30
LATE_FREE_MS = 300


@contextlib.contextmanager
def hard_slice(native: NativeBuild, held_gib: int) -> Iterator[Any]:
    """A container sealed to a hard 8 GiB slice of the card, beside a process outside Tessera
    (no libvgpu) holding `held_gib` of it; the cluster closed after."""
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(native, Path(d))
        try:
            hog = cluster.container("hog").cuctl(preload=False)
            assert hog("init")["ok"] and hog(f"alloc plain {held_gib * GiB}")["ok"], hog.stderr()
            k = cluster.container("k")
            k.seal(region.DeviceLimit("", 8 * GiB, 0))
            yield k
        finally:
            cluster.close()


def timed_alloc(c: Any) -> tuple[float, bool]:
    t0 = time.monotonic()
    r = c(f"alloc plain {8 * GiB}", timeout=30)
    return (time.monotonic() - t0) * 1000, r["ok"]


def full_card(native: NativeBuild) -> tuple[float, bool]:
    with hard_slice(native, 12) as k:
        c = k.cuctl()
        assert c("init")["ok"], c.stderr()
        return timed_alloc(c)


def late_free(native: NativeBuild) -> tuple[float, bool]:
    with hard_slice(native, 8) as k:
        a = k.cuctl()
        assert a("init")["ok"] and a(f"alloc plain {8 * GiB}")["ok"], a.stderr()
        a.p.kill()
        a.p.wait(timeout=10)
        b = k.cuctl(FAKE_EXIT_FREE_DELAY_MS=str(LATE_FREE_MS))
        assert b("init")["ok"], b.stderr()
        return timed_alloc(b)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    native = build_native()
    load0 = os.getloadavg()[0]
    rows = []
    for name, case, expect in (("full card, nothing coming back", full_card, False),
                               (f"a dead process's memory freed {LATE_FREE_MS} ms late",
                                late_free, True)):  # fmt: skip
        times = []
        for _ in range(runs):
            ms, ok = case(native)
            assert ok == expect, (name, ok)
            times.append(ms)
        answer = "granted" if expect else "CUDA OOM"
        rows.append(f"| {name} | {answer} | {statistics.median(times):.0f} | "
                    f"{min(times):.0f}–{max(times):.0f} |")  # fmt: skip
    load1 = os.getloadavg()[0]
    text = "\n".join([
        f"`python bench/libvgpu_owed_oom.py {runs}` (fake driver, a hard slice guaranteed 8 GiB "
        f"of 16 GiB, retry bound 1000 ms; load {load0:.1f} -> {load1:.1f}):",
        "",
        "| case | answer | median ms | range ms |",
        "|---|---|---|---|",
        *rows,
    ])
    print(text)
    record_section("libvgpu-owed-oom", text)


if __name__ == "__main__":
    main()
