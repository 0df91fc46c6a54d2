"""Every launch path goes through the throttled code and reaches the driver (quick; also run
under ASan, where the timing tests are skipped)."""

from __future__ import annotations

import pytest

from tessera import region

FIELD = {"kernel": "launches", "ptsz": "launches", "ex": "ex", "coop": "coop", "graph": "graph"}


@pytest.mark.parametrize("mode", ["direct", "dlsym", "procaddr"])
def test_throttled_launches_reach_the_driver(container, mode):
    container.seal(region.DeviceLimit("", 0, 50))
    c = container.cuctl(mode)
    assert c("init")["ok"]
    for path, field in FIELD.items():
        before = c("stats")[field]
        r = c(f"burn 0.15 k_200us {path}")
        assert r["rc"] == 0 and r["launches"] > 0
        assert c("stats")[field] - before == r["launches"]
    d = container.usage().devices[0]
    assert d.launches > 0 and d.busy_ns_total > 0 and d.last_kernel_ns > 0
    c.close()


def test_unthrottled_launches_count_activity(container):
    container.seal(region.DeviceLimit("", 0, 0))
    c = container.cuctl()
    c("init")
    c("alloc plain 4096")  # registers the process
    c("burn 0.1 k_100us kernel")
    c("sleep 60")  # a poll tick turns launches into activity
    u = container.usage()
    assert u.processes[0].launches > 0
    assert u.devices[0].last_kernel_ns > 0
    c.close()
