"""Judging a real-time compute share on the fake GPU's timeline, per window, fairly on a loaded
host: a window's lower bound is lowered by exactly the share of it the launcher spent waiting for
a CPU (conftest.CpuStarvation); the upper bound never depends on the host. Used by the compute
tests and by any test that checks a container's share."""

from __future__ import annotations

TOL = 5.0  # percentage points
SEC = 1_000_000_000


class Shares(list):
    """Achieved % per window, with the percentage points of each window the launchers spent
    waiting for a CPU (`starved`)."""

    def __init__(self, values, starved):
        super().__init__(values)
        self.starved = list(starved)
        assert len(self.starved) == len(self), (values, starved)


def shares(cluster, dev, t0, t1, window, pids) -> Shares:
    return Shares(cluster.busy(dev, t0, t1, window, pids), cluster.starved(pids, t0, t1, window))


def windows(cluster, dev, r, pids, window=SEC) -> Shares:
    return shares(cluster, dev, r["t0"], r["t1"], window, pids)


def show(values: Shares) -> str:
    return f"windows {[round(v, 1) for v in values]}, launcher CPU waits " + str(
        [round(w, 1) for w in values.starved]
    )


def assert_near(values: Shares, target, tol=TOL):
    """Every window within target ± tol; below only by what the launcher's CPU waits excuse;
    above only as catch-up: a window may make up what earlier ones fell short (the library
    banks up to 30 ms after a descheduled launcher, and refunds launches first charged their
    event time before NVML's first answer), never by more than another tol, and the run so far
    never holds more than target per window plus tol."""
    assert values, "no complete window"
    bad, total = [], 0.0
    for n, (v, w) in enumerate(zip(values, values.starved, strict=True), 1):
        total += v
        if v < target - tol - w or v > target + 2 * tol or total > n * target + tol:
            bad.append(round(v, 1))
    assert not bad, f"{show(values)} vs target {target}±{tol}"


def assert_above(values: Shares, floor):
    """Every window above `floor` (an unthrottled share), less the launcher's CPU waits."""
    assert values, "no complete window"
    bad = [round(v, 1) for v, w in zip(values, values.starved, strict=True) if v <= floor - w]
    assert not bad, f"{show(values)}: not above {floor}"
