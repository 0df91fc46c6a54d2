"""This machine's own spread, for reading a decision benchmark's p99 against it.

One fixed piece of work (2,500 dict reads in Python and a numpy sum over a 160 KB array: the
same instructions every time) timed with the thread's CPU clock, as `decision_lockstep.py`
times a call, 1,600 times (the first 20 not counted); between two timings 8 MB of other memory
is written, as the other version's call does in the lockstep (`BENCH_EVICT=0`: not). Whatever
p99 / p50 this reads is the machine's (caches, a busy sibling vCPU, interrupts), not the code's.

    python bench/noise_floor.py

Printed, not recorded.
"""

from __future__ import annotations

import os
import time

import numpy as np


def work(values: np.ndarray, table: dict[int, int]) -> int:
    total = 0
    for i in range(2500):
        total += table.get(i & 255, 0)
    return total + int(values[::7].sum())


def main() -> None:
    values = np.arange(20000, dtype=np.float64)
    table = {i: i for i in range(256)}
    other = bytearray(8 << 20)
    evict = os.environ.get("BENCH_EVICT", "1") != "0"
    ones = b"\1" * len(other[::64])
    times = []
    for _ in range(1620):
        if evict:
            other[::64] = ones
        started = time.thread_time_ns()
        work(values, table)
        times.append(time.thread_time_ns() - started)
    ms = np.array(times[20:]) / 1e6
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    load = os.getloadavg()[0]
    print(f"fixed work, caches {'evicted' if evict else 'kept'} between timings, load "
          f"{load:.2f}: p50 {p50:.3f} p90 {p90:.3f} p99 {p99:.3f} ms; p99 / p50 {p99 / p50:.2f}")


if __name__ == "__main__":
    main()
