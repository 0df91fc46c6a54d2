"""Two builds of libvgpu side by side on the allocation path, in the two standalone modes: env
limits (CUDA_DEVICE_MEMORY_LIMIT_0, the region from CUDA_DEVICE_MEMORY_SHARED_CACHE) and limits
sealed without the lease service (TESSERA_LIMITS_DIR; the region is the account, and each charge
is also locked in the region file: src/kacct.c). Per 1 MiB cuMemAlloc + cuMemFree: callgrind's
instructions (user space only: an fcntl's kernel time is not in them) and wall time, the builds
alternating run by run (tests/native/progs/bench.c, the fake driver with FAKE_BENCH=1).

    python bench/libvgpu_standalone.py OLD_LIBVGPU_SO [NEW_LIBVGPU_SO] [--reps N]

Build both first (make -C native/libvgpu; make -C tests/native; the old one with BUILD=...).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from tessera.region import ContainerLimits, DeviceLimit, prepare_region_file, seal_limits

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "native" / "libvgpu" / "build"
GPU0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0
MODES = ("env", "sealed")


def env(tmp: Path, lib: str, mode: str) -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "TESSERA_", "FAKE_", "LD_PRELOAD"))
    }
    e.update(
        FAKE_BENCH="1",
        LD_LIBRARY_PATH=str(BUILD / "tests" / "fake"),
        FAKE_CUDA_STATE=str(tmp / "gpu"),
        FAKE_GPU_MEM_MB="131072",
        LIBCUDA_LOG_LEVEL="0",
        LD_PRELOAD=lib,
    )
    if mode == "env":
        e.update(
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / "region-env"),
            CUDA_DEVICE_MEMORY_LIMIT_0="64g",
        )
    else:
        e["TESSERA_LIMITS_DIR"] = str(tmp / "sealed")
    return e


def wall_ns(tmp: Path, lib: str, mode: str, n: int) -> float:
    out = subprocess.run(
        [str(BUILD / "tests" / "bench"), "alloc", str(n)],
        env=env(tmp, lib, mode),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def instructions(tmp: Path, lib: str, mode: str, n: int) -> int:
    out = tmp / f"cg.{mode}.{n}.{abs(hash(lib))}"
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            str(BUILD / "tests" / "bench"),
            "alloc",
            str(n),
        ],
        env=env(tmp, lib, mode),
        capture_output=True,
        check=True,
    )
    m = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
    assert m, out
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=str(BUILD / "libvgpu.so"))
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    libs = {"old": a.old, "new": a.new}
    rows = [
        "| mode | build | instructions per alloc + free | wall ns, median (min-max) |",
        "|---|---|---|---|",
    ]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare_region_file(tmp / "region-sealed")
        seal_limits(
            tmp / "sealed",
            ContainerLimits(
                devices=(DeviceLimit(GPU0, 64 << 30),), region_path=str(tmp / "region-sealed")
            ),
        )
        for mode in MODES:
            for lib in libs.values():  # the fake's state and the region made before any count
                wall_ns(tmp, lib, mode, 10)
            per = {
                k: (instructions(tmp, lib, mode, 1100) - instructions(tmp, lib, mode, 100)) / 1000
                for k, lib in libs.items()
            }
            walls: dict[str, list[float]] = {k: [] for k in libs}
            for _ in range(a.reps):  # alternating: the machine's load changes over time
                for k, lib in libs.items():
                    walls[k].append(wall_ns(tmp, lib, mode, 50_000))
            for k in libs:
                w = walls[k]
                rows.append(
                    f"| {mode} | {k} | {per[k]:.1f} | {statistics.median(w):.1f} "
                    f"({min(w):.1f}-{max(w):.1f}) |"
                )
    print("\n".join(rows))
    print(f"\nload average {load:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
