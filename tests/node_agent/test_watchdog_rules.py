"""The watchdog's pure decisions: cgroup → pod, a pod's share of a GPU, breach timing."""

from __future__ import annotations

import pytest
from tessera.node_agent.watchdog_rules import (
    BreachJudge,
    ContainerShare,
    Seen,
    Share,
    WatchdogPolicy,
    combine,
    container_share,
    pod_uid_from_cgroup,
)

from tessera.region import ContainerLimits, DeviceLimit

MIB = 1 << 20
UID = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
KEY = (UID, "GPU-a")


@pytest.mark.parametrize("text", [
    # cgroup v2, systemd driver (dashes of the uid become underscores)
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}"
    ".slice/cri-containerd-0123abcd.scope\n",
    # cgroupfs driver, guaranteed QoS
    f"0::/kubepods/pod{UID}/0123abcd\n",
    # cgroup v1: one line per hierarchy, all naming the same pod
    f"12:memory:/kubepods/besteffort/pod{UID}/0123abcd\n"
    f"11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/0123abcd\n",
    # nested runtime (kind): the innermost pod component counts
    f"0::/docker/ffee/kubepods/burstable/pod{UID}/0123abcd\n",
])
def test_pod_uid_from_cgroup_drivers(text):
    assert pod_uid_from_cgroup(text) == UID


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-1000.slice/session-2.scope\n",  # not a pod
    "0::/system.slice/containerd.service\n",
    "",
    "garbage without colons",
    # two hierarchies disagree: trust neither
    f"12:memory:/kubepods/pod{UID}/a\n11:cpu:/kubepods/pod{UID[:-1]}0/a\n",
    "0::/kubepods/podnot-a-uid/abc\n",
])
def test_pod_uid_from_cgroup_refuses_what_is_not_one_pod(text):
    assert pod_uid_from_cgroup(text) is None


def limits(sm: int = 30, *, policy: str = "force", contended: bool = False,
           yield_: bool = False, yield_sm: int = 0, mem: int = 1000 * MIB) -> ContainerLimits:
    return ContainerLimits(
        devices=(DeviceLimit("GPU-a", mem, sm, contended=contended, yield_=yield_,
                             yield_sm_pct=yield_sm),),
        core_policy=policy,
    )


def test_compute_limit_in_force_follows_the_core_policy():
    assert container_share(limits(policy="force"), "GPU-a", False).sm_limit_pct == 30
    assert container_share(limits(policy="disable"), "GPU-a", False).sm_limit_pct is None
    # `default` limits only while another container is active on the GPU
    assert container_share(limits(policy="default"), "GPU-a", False).sm_limit_pct is None
    assert container_share(limits(policy="default", contended=True), "GPU-a",
                           False).sm_limit_pct == 30
    assert container_share(limits(yield_=True, yield_sm=5), "GPU-a", False).sm_limit_pct == 5
    assert container_share(limits(sm=100), "GPU-a", False).sm_limit_pct is None
    assert container_share(limits(), "GPU-other", False) is None


def test_a_pods_share_sums_app_containers_and_takes_the_largest_init():
    apps = [ContainerShare(False, 1000 * MIB, 20), ContainerShare(False, 500 * MIB, 10)]
    init = ContainerShare(True, 2000 * MIB, 10)
    assert combine(apps) == Share(1500 * MIB, 30)
    assert combine([*apps, init]) == Share(2000 * MIB, 30)
    assert combine([ContainerShare(False, 0, None), apps[0]]) == Share(0, None)  # unlimited
    assert combine([]) is None


def judge_run(judge, share, timeline):
    """timeline: [(t, used MiB, sm)] -> breaches per poll."""
    return [
        judge.judge(t, {KEY: share}, {KEY: Seen(used * MIB, sm, (42,))})
        for t, used, sm in timeline
    ]


def test_memory_breach_only_after_the_grace_period_and_once_per_episode():
    judge = BreachJudge(WatchdogPolicy(memory_grace_s=2.0))
    share = Share(1000 * MIB, None, claimed_bytes=2000 * MIB)
    out = judge_run(judge, share, [(0.0, 1100, None), (1.0, 1100, None), (1.9, 1100, None),
                                   (2.0, 1100, None), (2.5, 1100, None)])
    assert [len(x) for x in out] == [0, 0, 0, 1, 1]
    first, again = out[3][0], out[4][0]
    assert first.reason == "memory" and first.new and first.since == 0.0
    assert first.limit == 1000 * MIB and first.seen == 1100 * MIB and first.pids == (42,)
    assert not again.new  # still the same episode: published once


def test_memory_spikes_within_grace_and_within_margin_are_not_breaches():
    judge = BreachJudge(WatchdogPolicy(memory_grace_s=2.0))
    share = Share(1000 * MIB, None, claimed_bytes=2000 * MIB)
    spiky = [(0.0, 1500, None), (1.5, 1500, None), (2.0, 900, None), (2.5, 1500, None),
             (4.0, 1500, None), (4.4, 1040, None), (9.0, 1040, None)]  # 1040 < 1000 + 5 %
    assert all(not x for x in judge_run(judge, share, spiky))


def test_processes_gone_end_the_episode():
    judge = BreachJudge(WatchdogPolicy(memory_grace_s=1.0))
    share = Share(1000 * MIB, None, claimed_bytes=2000 * MIB)
    judge_run(judge, share, [(0.0, 1200, None), (1.0, 1200, None)])
    assert judge.judge(1.5, {KEY: share}, {}) == []
    again = judge_run(judge, share, [(2.0, 1200, None), (2.5, 1200, None), (3.0, 1200, None)])
    assert [len(x) for x in again] == [0, 0, 1] and again[2][0].new


def test_tampered_when_the_region_claims_less_than_nvml_shows():
    judge = BreachJudge(WatchdogPolicy(memory_grace_s=1.0, tamper_allowance_bytes=64 * MIB))
    honest = Share(4000 * MIB, None, claimed_bytes=900 * MIB)
    lying = Share(4000 * MIB, None, claimed_bytes=0)
    assert judge_run(judge, honest, [(0.0, 1000, None), (2.0, 1000, None)]) == [[], []]
    out = judge_run(judge, lying, [(3.0, 1000, None), (4.0, 1000, None)])
    assert out[0] == [] and [b.reason for b in out[1]] == ["tampered"]
    assert not out[1][0].enforceable and out[1][0].claimed == 0
    # a region that cannot be read claims nothing
    judge2 = BreachJudge(WatchdogPolicy(memory_grace_s=0.0, tamper_allowance_bytes=64 * MIB))
    (b,) = judge_run(judge2, Share(0, None, None), [(0.0, 500, None)])[0]
    assert b.reason == "tampered" and b.claimed is None


def test_compute_breach_is_judged_on_the_window_average():
    policy = WatchdogPolicy(compute_window_s=10.0, compute_margin_pct=10.0)
    share = Share(0, 30, claimed_bytes=None)
    judge = BreachJudge(policy)
    no_mem = WatchdogPolicy().tamper_allowance_bytes // MIB - 1
    # 45 % for the first half, then 20 %: mean 32.5 -> not beyond 30 + 10
    mixed = [(t / 2, no_mem, 45.0 if t < 10 else 20.0) for t in range(0, 22)]
    assert all(not x for x in judge_run(judge, share, mixed))
    judge = BreachJudge(policy)
    hot = [(t / 2, no_mem, 60.0 if t % 2 else 30.0) for t in range(0, 22)]  # mean 45
    out = judge_run(judge, share, hot)
    assert all(not x for x in out[:20])  # less than a whole window seen
    (b,) = out[20]
    assert b.reason == "compute" and b.new and b.limit == 30 and 44 <= b.seen <= 46


def test_compute_not_judged_without_a_limit_in_force_or_without_utilisation():
    policy = WatchdogPolicy(compute_window_s=2.0)
    judge = BreachJudge(policy)
    free = Share(0, None)
    assert all(not x for x in judge_run(judge, free, [(t, 1, 100.0) for t in range(6)]))
    judge = BreachJudge(policy)
    blind = Share(0, 30)
    assert all(not x for x in judge_run(judge, blind, [(t, 1, None) for t in range(6)]))


def test_unknown_share_is_ignored():
    judge = BreachJudge(WatchdogPolicy(memory_grace_s=0))
    assert judge.judge(0.0, {}, {KEY: Seen(10**12, 100.0, (7,))}) == []


def test_unattested_are_the_pids_without_a_lease_connection_from_their_pod():
    from tessera.node_agent.watchdog_rules import unattested

    seen = Seen(900 * MIB, None, (10, 11, 12))
    # 10 leases for this pod, 11 for another pod (its connection proves nothing here), 12 none
    assert unattested(seen, UID, {10: UID, 11: "another-pod"}) == (11, 12)
    assert unattested(seen, UID, {10: UID, 11: UID, 12: UID}) == ()


def test_over_lease_allows_each_process_its_context():
    from tessera.node_agent.watchdog_rules import over_lease

    two = Seen(1000 * MIB, None, (1, 2))
    assert not over_lease(two, 500 * MIB, 256 * MIB)  # 500 leased + 2 x 256 of contexts
    assert over_lease(two, 400 * MIB, 256 * MIB)
    assert over_lease(Seen(300 * MIB, None, ()), 0, 256 * MIB)  # no pid listed: one allowance
