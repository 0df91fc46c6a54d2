"""The lending policy (weighted fair share up to each burst) and the lender's tick against real
limits files and regions: what the node agent seals for each container, and what a tenant's own
region can and cannot change about it."""

from __future__ import annotations

import os
import time

import pytest

from tessera import region
from tessera.elastic_compute import (
    ComputeClaim,
    ComputeLender,
    LendingMember,
    lend_compute,
    read_device_activity,
)

GPU = "GPU-fa4e0000-0000-0000-0000-000000000000"


def claims(*specs):
    return [ComputeClaim(k, g, b, busy) for k, g, b, busy in specs]


def test_only_the_busy_container_is_lent_the_card_up_to_its_burst():
    allow = lend_compute(claims(("a", 10, 100, True), ("b", 30, 100, False), ("c", 60, 100, False)))
    assert allow == {"a": 10000, "b": 3000, "c": 6000}  # idle ones keep their guarantee
    capped = lend_compute(claims(("a", 10, 50, True), ("b", 30, 100, False)))
    assert capped["a"] == 5000


def test_every_container_busy_gets_its_guarantee():
    allow = lend_compute(claims(("a", 10, 100, True), ("b", 30, 100, True), ("c", 60, 100, True)))
    assert allow == {"a": 1000, "b": 3000, "c": 6000}


def test_idle_share_is_split_in_proportion_and_a_capped_share_goes_to_the_others():
    # 90 % guaranteed, all busy: the idle 10 % in proportion 10:30:50
    allow = lend_compute(claims(("a", 10, 100, True), ("b", 30, 100, True), ("c", 50, 100, True)))
    assert allow == {"a": 1111, "b": 3333, "c": 5556}
    assert sum(allow.values()) == 10000
    # a hard slice (burst = guarantee) is capped at once; the rest goes to the elastic one
    allow = lend_compute(claims(("hard", 25, 25, True), ("noisy", 10, 100, True)))
    assert allow == {"hard": 2500, "noisy": 7500}
    # an elastic one capped below its proportional share passes the rest on
    allow = lend_compute(claims(("a", 50, 55, True), ("b", 10, 100, True), ("c", 10, 100, False)))
    assert allow == {"a": 5500, "b": 4500, "c": 1000}


def test_overcommitted_guarantees_are_never_cut():
    allow = lend_compute(claims(("a", 60, 100, True), ("b", 60, 100, True)))
    assert allow == {"a": 6000, "b": 6000}


def seal(tmp_path, name, guarantee, burst=None):
    d = tmp_path / name
    r = d / "region"
    region.prepare_region_file(r)
    region.seal_limits(d / "limits", region.ContainerLimits(
        devices=(region.device_limit(GPU, sm_guarantee_pct=guarantee, sm_burst_pct=burst),),
        core_policy="force",
    ))
    return LendingMember(name, d / "limits", r)


def set_activity(member: LendingMember, ns: int) -> None:
    """A region as libvgpu leaves it: one device, GPU, last_kernel_ns = ns."""
    with open(member.region_path, "r+b") as f:
        c = region.RegionC.from_buffer_copy(f.read())
        c.num_devices = 1
        c.dev[0].uuid = GPU.encode()
        c.dev[0].last_kernel_ns = ns
        f.seek(0)
        f.write(bytes(c))


def allowance(member: LendingMember) -> int:
    return region.read_limits(member.limits_dir).device(GPU).sm_allow_x100


def test_the_lender_seals_allowances_and_rewrites_only_on_change(tmp_path):
    a, b, hard = seal(tmp_path, "a", 10, 100), seal(tmp_path, "b", 30, 100), seal(tmp_path, "h", 20)
    lender = ComputeLender(idle_after_s=0.2)
    now = time.time_ns()
    set_activity(a, now)
    set_activity(b, now - 1_000_000_000)  # idle for a second
    set_activity(hard, now)
    gpus = {GPU: [a, b, hard]}
    applied = lender.tick(gpus, now)
    assert applied == {("a", GPU): 8000, ("b", GPU): 3000}  # the hard slice keeps its 20
    assert (allowance(a), allowance(b), allowance(hard)) == (8000, 3000, 0)
    rewrites = lender.rewrites
    lender.tick(gpus, now)
    assert lender.rewrites == rewrites  # nothing changed: no file rewritten
    set_activity(b, now)  # b wakes
    lender.tick(gpus, now + 1_000_000)
    assert (allowance(a), allowance(b)) == (2000, 6000)  # 80 % split 10:30
    # b's wake took lent compute back from a, which was busy: one reclaim, for b (the one that
    # woke; the hard slice was busy all along)
    assert [(t.key, t.before_x100, t.after_x100, t.for_keys) for t in lender.taken] == [
        ("a", 8000, 2000, ("b",))]
    assert lender.reclaims_of == {("a", GPU): 1} and lender.reclaims == 1
    # everyone idle: guarantees; falling back while idle takes nothing from anyone busy
    lender.tick(gpus, now + 10_000_000_000)
    assert (allowance(a), allowance(b)) == (1000, 3000)
    assert lender.taken == [] and lender.reclaims == 1


def test_a_tenant_that_forges_activity_gets_no_more_than_its_fair_share(tmp_path):
    """The region is the tenant's to write: stamping it busy (even in the future) makes the
    container count as busy, nothing more: its allowance is still its weighted share, and a
    damaged or foreign region just reads as idle."""
    a, b = seal(tmp_path, "a", 10, 100), seal(tmp_path, "b", 30, 100)
    lender = ComputeLender()
    now = time.time_ns()
    set_activity(a, now + 3600 * 10**9)  # a forged stamp, an hour ahead
    set_activity(b, now)
    lender.tick({GPU: [a, b]}, now)
    assert (allowance(a), allowance(b)) == (2500, 7500)
    os.truncate(a.region_path, 100)  # truncated: idle, keeps its guarantee
    assert read_device_activity(a.region_path) == {}
    lender.tick({GPU: [a, b]}, now)
    assert (allowance(a), allowance(b)) == (1000, 10000)


def test_a_container_gone_meanwhile_does_not_stop_the_tick(tmp_path):
    a, b = seal(tmp_path, "a", 10, 100), seal(tmp_path, "b", 30, 100)
    set_activity(a, time.time_ns())
    (b.limits_dir / "limits").unlink()
    lender = ComputeLender()
    assert lender.tick({GPU: [a, b]}, time.time_ns()) == {("a", GPU): 10000}


def test_the_watchdog_judges_an_elastic_container_by_its_burst():
    from tessera.node_agent.watchdog_rules import container_share

    def share(dev):
        return container_share(region.ContainerLimits(devices=(dev,), core_policy="force"),
                               GPU, False).sm_limit_pct

    assert share(region.device_limit(GPU, sm_guarantee_pct=10, sm_burst_pct=60)) == 60
    assert share(region.device_limit(GPU, sm_guarantee_pct=10)) == 10


@pytest.mark.parametrize("burst", [None, 10])
def test_the_node_agent_seals_a_hard_slice_as_before(burst):
    from tessera.node_agent.containers import sealed_device_limit

    dev = sealed_device_limit(GPU, memory_mib=4000, cores=10, cores_burst=burst,
                              memory_burst_mib=None if burst is None else 4000)
    assert dev == region.DeviceLimit(GPU, 4000 << 20, 10)
    elastic = sealed_device_limit(GPU, memory_mib=4000, cores=10, memory_burst_mib=12000,
                                  cores_burst=150)
    assert (elastic.mem_burst_bytes, elastic.sm_burst_pct) == (12000 << 20, 100)
    with pytest.raises(ValueError, match="below the guarantee"):
        sealed_device_limit(GPU, memory_mib=4000, cores=10, memory_burst_mib=2000)
