"""Several containers sharing one fake GPU, each under its own compute limit: what each got (the
fake device's timeline: the truth) and what each published in its region (achieved %).

Used by tests/native/test_compute_sharing.py (correctness) and bench/libvgpu_sharing.py
(figures for bench/RESULTS.md).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from tessera import region

SEC = 1_000_000_000


@dataclass
class Share:
    limit: int
    pid: int
    got: float  # % of the device over the measured interval (fake timeline)
    windows: list[float]  # % per 1 s window
    published: list[tuple[float, float]] = field(default_factory=list)  # (achieved, truth)
    starved: float = 0.0  # points of the interval its launcher waited for a CPU (a loaded host)

    @property
    def worst_published_error(self) -> float:
        return max((abs(a - t) for a, t in self.published), default=float("nan"))


def run_sharing(
    cluster,
    limits: list[int],
    seconds: float = 6.0,
    warmup: float = 2.0,
    kernel: str = "k_10000us",
    depth: int = 4,
    dev: int = 0,
    pid_offset: int = 0,
    map_host_pids: bool = False,
) -> list[Share]:
    """Start one burning process per container (limit in %, policy force) on one GPU; measure
    from `warmup` after the last one started until the first one stops.

    pid_offset: the fake NVML reports pids shifted by it (a pid namespace seen from the host);
    map_host_pids: write each process's host pid into its region slot, as the node agent does."""
    procs = []
    for i, lim in enumerate(limits):
        k = cluster.container(f"share{i}")
        k.seal(region.DeviceLimit("", 0, lim))
        c = k.cuctl(FAKE_NVML_PID_OFFSET=str(pid_offset))
        assert c(f"init {dev}")["ok"]
        if map_host_pids:  # an allocation registers the process in its region
            r = c("alloc plain 4096")
            assert r["ok"] and c(f"free {r['id']}")["ok"]
            slot = next(p.slot for p in k.usage().processes if p.pid == c.pid)
            region.set_host_pid(k.region_path, slot, c.pid + pid_offset)
        procs.append((k, c))
    for _, c in procs:
        c.send(f"burnq {seconds + warmup} {kernel} {depth}")
    # what each container publishes, sampled while they run: (monotonic ns, achieved %)
    seen: list[list[tuple[int, float]]] = [[] for _ in procs]
    t_end = time.monotonic() + seconds + warmup
    while time.monotonic() < t_end:
        for i, (k, _) in enumerate(procs):
            u = region.read_region(k.region_path)
            d = u.devices[0] if u and u.devices else None
            a = d.achieved_sm_pct if d else None
            if a is not None:
                seen[i].append((time.monotonic_ns(), a))
        time.sleep(0.05)
    results = [c.recv(timeout=60) for _, c in procs]
    assert all(r["rc"] == 0 for r in results), results
    t0 = max(r["t0"] for r in results) + int(warmup * SEC)
    t1 = min(r["t1"] for r in results)
    assert t1 - t0 >= SEC, "the runs did not overlap long enough"
    shares = []
    for i, ((_, c), lim) in enumerate(zip(procs, limits, strict=True)):
        whole = cluster.busy(dev, t0, t1, t1 - t0, [c.pid])[0]
        s = Share(lim, c.pid, whole, cluster.busy(dev, t0, t1, SEC, [c.pid]))
        s.published = published_vs_truth(cluster, dev, c.pid, seen[i], t0, t1)
        s.starved = cluster.starved([c.pid], t0, t1, t1 - t0)[0]
        shares.append(s)
    return shares


BIN = 50_000_000  # ns


def published_vs_truth(cluster, dev, pid, samples, t0, t1) -> list[tuple[float, float]]:
    """Each published figure (read at ts) describes a ~1 s window that ended at most ~1.05 s
    before ts (a window ends at an NVML answer, every 0.5 s, and spans two of them). The device's
    truth for it: the 1 s window, ending in [ts - 1.05 s, ts], closest to the figure (the test
    cannot see exactly when libvgpu closed it). One figure per 0.5 s of the run."""
    start = t0 - 2 * SEC
    bins = cluster.busy(dev, start, t1, BIN, [pid])
    per_window = SEC // BIN

    def truth_ending(e: int) -> float:
        k = (e - start) // BIN
        return sum(bins[k - per_window : k]) / per_window

    out, last = [], 0
    for ts, a in samples:
        if ts - SEC - 100_000_000 < t0 or ts > t1 or ts - last < SEC // 2:
            continue
        last = ts
        ends = range(ts - 1_050_000_000, ts + 1, BIN)
        out.append((a, min((truth_ending(e) for e in ends), key=lambda t: abs(t - a))))
    return out


def summary(shares: list[Share]) -> str:
    return ", ".join(
        f"{s.limit}%->{s.got:.1f} (windows {min(s.windows):.1f}..{max(s.windows):.1f}, "
        f"published err {s.worst_published_error:.2f}, mean pub "
        f"{statistics.fmean(a for a, _ in s.published) if s.published else float('nan'):.2f}, "
        f"launcher starved {s.starved:.1f})"
        for s in shares
    )
