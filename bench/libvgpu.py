"""What libvgpu adds to a program: per unthrottled launch, per allocation, at start-up.

Runs tests/native/progs/bench.c against the fake driver (FAKE_BENCH=1: the fake does as little
as possible), with and without the preload, interleaved in the same run; then the same under
callgrind, whose instruction counts do not depend on how busy the machine is; then 256 processes
starting at the same instant, each timing its CUDA start-up (cuInit .. first allocation, which
is when libvgpu initialises). Records the figures in bench/RESULTS.md (section "libvgpu").

    python bench/libvgpu.py [--quick]
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import record_section

from tessera.region import ContainerLimits, DeviceLimit, prepare_region_file, seal_limits

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "native" / "libvgpu" / "build"
TARGETS = {"launch_ns": 50.0, "alloc_ns": 1000.0, "startup_p99_ms": 50.0}


def build() -> None:
    py = f"PYTHON={sys.executable}"
    for args in (
        ["-C", str(ROOT / "native" / "libvgpu"), f"BUILD={BUILD}", py],
        ["-C", str(ROOT / "tests" / "native"), f"BUILD={BUILD / 'tests'}", py],
    ):
        subprocess.run(["make", "-s", "-j4", *args], check=True)


GPU0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0
LEASED: Path | None = None  # a limits directory sealed with leases, its lease service running


def serve_leases(tmp: Path) -> None:
    """What the node agent does for a container: limits sealed with `lease`, a prepared region,
    the lease service on its socket (its own event loop, in a thread of this process)."""
    global LEASED
    from tessera.node_agent.leases import ContainerLeases

    limits = tmp / "leased-limits"
    prepare_region_file(tmp / "leased-region")
    seal_limits(limits, ContainerLimits(devices=(DeviceLimit(GPU0, 64 << 30),), lease=True,
                                        region_path=str(tmp / "leased-region")))  # fmt: skip
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    leases = ContainerLeases("bench/0", limits, logging.getLogger("bench.leases"))
    asyncio.run_coroutine_threadsafe(leases.start(), loop).result(10)
    LEASED = limits


def env(tmp: Path, preload: bool, leased: bool = False) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "TESSERA_", "FAKE_"))}
    e.pop("LD_PRELOAD", None)
    e.update(
        FAKE_BENCH="1",
        LD_LIBRARY_PATH=str(BUILD / "tests" / "fake"),
        FAKE_CUDA_STATE=str(tmp / "gpu"),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / "region"),
        CUDA_DEVICE_MEMORY_LIMIT_0="64g",
        FAKE_GPU_MEM_MB="131072",
        LIBCUDA_LOG_LEVEL="0",
    )
    if preload:
        e["LD_PRELOAD"] = str(BUILD / "libvgpu.so")
    if leased:  # the limits from the sealed file, memory leased from the agent's socket
        assert LEASED is not None
        e["TESSERA_LIMITS_DIR"] = str(LEASED)
    return e


def bench(tmp: Path, mode: str, n: int, preload: bool, leased: bool = False) -> float:
    out = subprocess.run(
        [str(BUILD / "tests" / "bench"), mode, str(n)],
        env=env(tmp, preload, leased),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def interleaved(tmp: Path, mode: str, n: int, reps: int) -> tuple[float, float, float]:
    """Medians without libvgpu, with it (env limits, the region), with it leasing."""
    without, with_, leased = [], [], []
    for _ in range(reps):
        without.append(bench(tmp, mode, n, False))
        with_.append(bench(tmp, mode, n, True))
        leased.append(bench(tmp, mode, n, True, leased=True))
    return statistics.median(without), statistics.median(with_), statistics.median(leased)


def instructions(tmp: Path, mode: str, n: int, preload: bool, leased: bool = False) -> int:
    out_file = tmp / f"cg.{mode}.{n}.{int(preload)}.{int(leased)}"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
         str(BUILD / "tests" / "bench"), mode, str(n)],
        env=env(tmp, preload, leased), capture_output=True, text=True, check=True,
    )  # fmt: skip
    m = re.search(r"^(?:summary|totals): (\d+)", out_file.read_text(), re.M)
    assert m, out_file
    return int(m.group(1))


def instructions_added(
    tmp: Path, mode: str, n1: int, n2: int
) -> tuple[float, float, float]:
    """(instructions per operation without, added per operation, added when leasing)."""
    per = {}
    for preload, leased in ((False, False), (True, False), (True, True)):
        per[preload, leased] = (
            instructions(tmp, mode, n2, preload, leased)
            - instructions(tmp, mode, n1, preload, leased)
        ) / (n2 - n1)
    base = per[False, False]
    return base, per[True, False] - base, per[True, True] - base


def startup(tmp: Path, procs: int, preload: bool, leased: bool = False) -> list[float]:
    """ms from the common start instant to the first allocation done, for each process. On a
    busy machine spawning them all can take longer than the lead time: then again, with more."""
    for lead_s in (3, 8, 20):
        try:
            return startup_once(tmp, procs, preload, lead_s, leased)
        except TimeoutError:
            continue
    raise RuntimeError("could not start the processes before the common instant")


def startup_once(
    tmp: Path, procs: int, preload: bool, lead_s: int, leased: bool = False
) -> list[float]:
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    deadline = time.monotonic_ns() + lead_s * 1_000_000_000
    e = env(run_dir, preload, leased)
    ps = [
        subprocess.Popen(
            [str(BUILD / "tests" / "bench"), "startup", str(deadline)],
            env=e,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    if time.monotonic_ns() > deadline:
        for p in ps:
            p.communicate(timeout=120)
        raise TimeoutError
    out = []
    for p in ps:
        stdout, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"startup bench exited {p.returncode}")
        out.append(int(stdout) / 1e6)
    return out


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    quick = "--quick" in sys.argv
    build()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reps = 3 if quick else 9
        serve_leases(tmp)
        l0, l1, l2 = interleaved(tmp, "launch", 200_000, reps)
        a0, a1, a2 = interleaved(tmp, "alloc", 50_000, reps)
        have_vg = shutil.which("valgrind") is not None
        if have_vg:
            li0, li, lil = instructions_added(tmp, "launch", 1_000, 11_000)
            ai0, ai, ail = instructions_added(tmp, "alloc", 100, 1_100)
        rounds = 2 if quick else 5
        s0, s1, s2 = [], [], []
        for _ in range(rounds):  # alternate: the machine's load changes over time
            s0.append(startup(tmp, 256, False))
            s1.append(startup(tmp, 256, True))
            s2.append(startup(tmp, 256, True, leased=True))

    load_after = os.getloadavg()[0]
    launch_added = l1 - l0
    alloc_added = a1 - a0
    p50_0 = statistics.median(p(r, 50) for r in s0)
    p50_1 = statistics.median(p(r, 50) for r in s1)
    p99_0 = statistics.median(p(r, 99) for r in s0)
    p99_1 = statistics.median(p(r, 99) for r in s1)
    p50_2 = statistics.median(p(r, 50) for r in s2)
    p99_2 = statistics.median(p(r, 99) for r in s2)
    startup_added = p99_1 - p99_0

    def verdict(value: float, target: float) -> str:
        return "met" if value <= target else "**missed**"

    rows = [
        "| what | without libvgpu | with libvgpu | added | leasing (agent's account) | "
        "added | target |",
        "|---|---|---|---|---|---|---|",
        f"| unthrottled cuLaunchKernel (median of {reps}, ns) | {l0:.1f} | {l1:.1f} | "
        f"{launch_added:.1f} | {l2:.1f} | {l2 - l0:.1f} | ≤ 50 ns: "
        f"{verdict(max(launch_added, l2 - l0), 50)} |",
        f"| cuMemAlloc + cuMemFree, 1 MiB (median of {reps}, ns) | {a0:.1f} | {a1:.1f} | "
        f"{alloc_added:.1f} | {a2:.1f} | {a2 - a0:.1f} | ≤ 1 µs: "
        f"{verdict(max(alloc_added, a2 - a0), 1000)} |",
    ]
    if have_vg:
        rows += [
            f"| instructions per launch (callgrind) | {li0:.1f} | {li0 + li:.1f} | {li:.1f} | "
            f"{li0 + lil:.1f} | {lil:.1f} | |",
            f"| instructions per alloc + free (callgrind) | {ai0:.1f} | {ai0 + ai:.1f} | "
            f"{ai:.1f} | {ai0 + ail:.1f} | {ail:.1f} | |",
        ]
    rows += [
        f"| start-up, 256 processes at once: p50 (ms, median of {rounds} rounds) | {p50_0:.2f} | "
        f"{p50_1:.2f} | {p50_1 - p50_0:.2f} | {p50_2:.2f} | {p50_2 - p50_0:.2f} | |",
        f"| start-up, 256 processes at once: p99 (ms, median of {rounds} rounds) | {p99_0:.2f} | "
        f"{p99_1:.2f} | {startup_added:.2f} | {p99_2:.2f} | {p99_2 - p99_0:.2f} | "
        f"≤ 50 ms: {verdict(startup_added, 50)} |",
    ]
    text = "\n".join(rows) + (
        "\n\nMeasured against the fake driver of tests/native with FAKE_BENCH=1 (launches and "
        "allocations cost the fake almost nothing), so the *added* column is libvgpu's own cost. "
        "Launches are unthrottled (no compute limit), allocations are under a memory limit (the "
        "reservation in the shared region is taken). *Leasing*: the limits sealed with "
        "`lease` (as the node agent seals them) and the agent's lease service (leases.py) "
        "answering on its socket in this process: a process leases 64 MiB at a time, so an "
        "allocation that fits its lease costs one compare-and-swap more, and start-up one "
        "connection to the service. Start-up: each process waits for a common "
        "instant, then times cuInit, its context and its first allocation (libvgpu reads the "
        "limits, maps the region and registers the process there), all 256 contending for the "
        "region at once. Wall times are medians of interleaved runs on a shared machine (load "
        f"average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cores: "
        "under load every wall time, with or without libvgpu, stretches); the callgrind rows "
        "count instructions and do not depend on load. Command: "
        "`python bench/libvgpu.py` (in `make bench`). On a real GPU: native/libvgpu/gpu-check.sh."
    )
    print(text)
    record_section("libvgpu", text)


if __name__ == "__main__":
    main()
