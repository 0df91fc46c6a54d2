"""Elastic compute on one fake GPU: containers with a guarantee and a burst limit, the node
agent's lending policy (tessera.elastic_compute.ComputeLender) ticking beside them as the agent
runs it, what each container got read off the device's timeline (the truth, per pid).

Used by tests/native/test_compute_elastic.py (correctness) and bench/libvgpu_elastic.py (figures).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tessera import region
from tessera.elastic_compute import LEND_INTERVAL_S, ComputeLender, LendingMember

SEC = 1_000_000_000
MS = 1_000_000
UUID0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0


class LenderThread:
    """The node agent's lending loop (services/node-agent/lending.py runs the same tick), on
    CLOCK_REALTIME like libvgpu's activity stamps. Records when each allowance changed
    (CLOCK_MONOTONIC ns, as cuctl's t0/t1 and the fake timeline)."""

    def __init__(self, members: list[LendingMember], uuid: str = UUID0,
                 interval_s: float = LEND_INTERVAL_S):
        self.gpus = {uuid: members}
        self.uuid = uuid
        self.interval_s = interval_s
        self.lender = ComputeLender()
        self.changes: list[tuple[int, str, int]] = []  # (monotonic ns, key, allowance x100)
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lender", daemon=True)

    def __enter__(self) -> LenderThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            applied = self.lender.tick(self.gpus, time.time_ns())
            now = time.monotonic_ns()
            for (key, _), allow in applied.items():
                if self._last.get(key) != allow:
                    self._last[key] = allow
                    self.changes.append((now, key, allow))
            self._stop.wait(self.interval_s)

    def first_change_after(self, key: str, t_ns: int, below: int) -> int | None:
        """When (monotonic ns) `key`'s allowance first went below `below` after t_ns."""
        return next((t for t, k, a in self.changes if k == key and t >= t_ns and a < below), None)


@dataclass
class Tenant:
    name: str
    guarantee: int
    burst: int | None  # None: a hard slice
    container: object = None
    cuctl: object = None
    runs: list[dict] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.cuctl.pid

    @property
    def member(self) -> LendingMember:
        k = self.container
        return LendingMember(self.name, k.limits_dir, k.region_path)


def start_tenants(cluster, specs: list[tuple[str, int, int | None]], dev: int = 0,
                  uuid: str = UUID0) -> list[Tenant]:
    """One container and one launcher process per (name, guarantee %, burst % or None)."""
    out = []
    for name, guarantee, burst in specs:
        t = Tenant(name, guarantee, burst)
        t.container = cluster.container(name)
        t.container.seal(region.device_limit(uuid, sm_guarantee_pct=guarantee,
                                             sm_burst_pct=burst))
        t.cuctl = t.container.cuctl()
        assert t.cuctl(f"init {dev}")["ok"]
        out.append(t)
    return out


def burn(t: Tenant, seconds: float, kernel: str, depth: int) -> None:
    t.cuctl.send(f"burnq {seconds} {kernel} {depth}")


def finish(t: Tenant, timeout: float = 60) -> dict:
    r = t.cuctl.recv(timeout=timeout)
    assert r["rc"] == 0, r
    t.runs.append(r)
    return r


def share(cluster, t: Tenant, a: int, b: int, dev: int = 0) -> float:
    """% of the device tenant t's process held over [a, b) (monotonic ns), off the timeline."""
    return cluster.busy(dev, a, b, b - a, [t.pid])[0]


def bins(cluster, t: Tenant, a: int, b: int, width: int, dev: int = 0) -> list[float]:
    """% of the device tenant t held in each `width` bin of [a, b)."""
    return cluster.busy(dev, a, b, width, [t.pid])


def settle_time(cluster, tenants: list[Tenant], t_wake: int, window: int, tol: float,
                step: int = 10 * MS, limit: int = 2 * SEC, dev: int = 0) -> int | None:
    """The first T (ns after t_wake, in `step`s) from which every tenant's share of the device
    over [t_wake + T, t_wake + T + window) is within ±tol points of its guarantee; None if not
    within `limit` (or the runs ended first)."""
    per = window // step
    series = {t.name: bins(cluster, t, t_wake, t_wake + limit + window, step, dev)
              for t in tenants}
    n = min(len(v) for v in series.values())
    for i in range(0, n - per + 1):
        if all(abs(sum(series[t.name][i:i + per]) / per - t.guarantee) <= tol for t in tenants):
            return i * step
    return None


@dataclass
class LendAndReclaim:
    """Shares 10/30/60 (each elastic up to `burst`): all busy, then only the first, then the
    others wake."""

    all_busy: list[float]  # % of the device each got, all busy (after the warm-up)
    all_busy_starved: list[float]  # points of that window each launcher waited for a CPU
    alone: float  # the first one's %, alone (from 0.5 s after the others stopped)
    alone_starved: float
    lender_reaction_ms: float | None  # wake -> the borrower's allowance lowered (agent's tick)
    settle_ms: dict[str, float | None]  # window length -> first T after wake from which every
    #                                     share over [T, T + window) is within ±tol
    after_wake: list[float]  # each one's % over [wake + 100 ms, wake + 1.1 s)
    after_wake_starved: list[float]
    early_bins: dict[str, list[float]]  # % per 20 ms for 300 ms from the wake
    late_bins: dict[str, list[float]]  # % per 100 ms for 2 s from the wake
    rewrites: int  # limits files the lender rewrote over the run
    changes: list[tuple[float, str, int]]  # (s from the first start, key, allowance x100)


def run_lend_and_reclaim(cluster, specs=(("a", 10, 100), ("b", 30, 100), ("c", 60, 100)),
                         kernel: str = "k_2000us", depth: int = 8, busy_s: float = 3.0,
                         alone_s: float = 3.0, wake_s: float = 2.5, warmup_s: float = 1.0,
                         tol: float = 2.0) -> LendAndReclaim:
    tenants = start_tenants(cluster, list(specs))
    first, others = tenants[0], tenants[1:]
    with LenderThread([t.member for t in tenants]) as lt:
        burn(first, busy_s + alone_s + wake_s + 1.0, kernel, depth)
        for t in others:
            burn(t, busy_s, kernel, depth)
        ends = [finish(t)["t1"] for t in others]
        time.sleep(alone_s)
        for t in others:
            burn(t, wake_s, kernel, depth)
        wakes = [finish(t)["t0"] for t in others]
        r_first = finish(first)
    t_busy0, t_busy1 = r_first["t0"] + int(warmup_s * SEC), min(ends)
    t_wake = min(wakes)
    pids = [t.pid for t in tenants]
    alone_a, alone_b = t_busy1 + SEC // 2, t_wake
    after_a, after_b = t_wake + 100 * MS, t_wake + 1100 * MS
    reaction = lt.first_change_after(first.name, t_wake, first.burst * 100)
    return LendAndReclaim(
        all_busy=[share(cluster, t, t_busy0, t_busy1) for t in tenants],
        all_busy_starved=cluster.starved(pids, t_busy0, t_busy1, t_busy1 - t_busy0) * len(pids),
        alone=share(cluster, first, alone_a, alone_b),
        alone_starved=cluster.starved([first.pid], alone_a, alone_b, alone_b - alone_a)[0],
        lender_reaction_ms=None if reaction is None else (reaction - t_wake) / MS,
        settle_ms={
            f"{w // MS} ms": (None if (s := settle_time(cluster, tenants, t_wake, w, tol)) is None
                              else s / MS)
            for w in (250 * MS, 500 * MS, SEC)
        },
        after_wake=[share(cluster, t, after_a, after_b) for t in tenants],
        after_wake_starved=cluster.starved(pids, after_a, after_b, after_b - after_a) * len(pids),
        early_bins={t.name: bins(cluster, t, t_wake, t_wake + 300 * MS, 20 * MS)
                    for t in tenants},
        late_bins={t.name: bins(cluster, t, t_wake, t_wake + 2 * SEC, 100 * MS)
                   for t in tenants},
        rewrites=lt.lender.rewrites,
        changes=[((t - r_first["t0"]) / SEC, k, a) for t, k, a in lt.changes],
    )


@dataclass
class NoisyNeighbour:
    guaranteed_alone: float  # the guaranteed container's %, alone
    guaranteed_noisy: float  # ... beside the noisy neighbour at full burst
    noisy: float  # the neighbour's %
    starved_alone: float
    starved_noisy: float

    @property
    def slowdown_pct(self) -> float:
        return 100.0 * (self.guaranteed_alone - self.guaranteed_noisy) / self.guaranteed_alone


def run_noisy_neighbour(cluster, guaranteed: int = 25, noisy: tuple[int, int] = (10, 100),
                        kernel: str = "k_2000us", depth: int = 8,
                        seconds: float = 3.0) -> NoisyNeighbour:
    """A hard slice (`guaranteed` %) alone, then beside an elastic neighbour (guarantee, burst)
    burning as fast as it is let: the slice's share of the device, both ways."""
    g, n = start_tenants(cluster, [("guaranteed", guaranteed, None),
                                   ("noisy", noisy[0], noisy[1])])
    with LenderThread([g.member, n.member]):
        burn(g, 2 * seconds + 1.5, kernel, depth)
        time.sleep(seconds + 0.5)
        burn(n, seconds + 0.5, kernel, depth)
        rn = finish(n)
        rg = finish(g)
    a0, a1 = rg["t0"] + SEC // 2, rn["t0"]
    b0, b1 = rn["t0"] + SEC // 2, rn["t1"]
    return NoisyNeighbour(
        guaranteed_alone=share(cluster, g, a0, a1),
        guaranteed_noisy=share(cluster, g, b0, b1),
        noisy=share(cluster, n, b0, b1),
        starved_alone=cluster.starved([g.pid], a0, a1, a1 - a0)[0],
        starved_noisy=cluster.starved([g.pid, n.pid], b0, b1, b1 - b0)[0],
    )
