"""The node agent's watchdog, end to end: the fake NVML reports real processes (that never go
through libvgpu), a fake /proc maps them to pods, the agent runs with a real NATS, and the
tenant's processes are really killed (or only reported)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry
from watchdog_rig import MIB, Breaches, WatchEnv, admit, make_env, wait_exit, watched_rig

from tessera.settings import TesseraSettings

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

GRACE_S = 2.0  # the default memory grace period


@pytest.fixture
def env(
    short_dir: Path, fake_nvml_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WatchEnv]:
    watch_env = make_env(short_dir, fake_nvml_lib, monkeypatch)
    try:
        yield watch_env
    finally:
        watch_env.cleanup()


def breach_counter(events, reason: str) -> float:
    """tessera_limit_breaches_total{reason} as the metrics service computes it from events."""
    view = ClusterView()
    for seq, event in enumerate(events, 1):
        view.apply_event(event, seq)
    text = generate_latest(build_registry(view, TesseraSettings(), time.time)).decode()
    line = next(x for x in text.splitlines()
                if x.startswith(f'tessera_limit_breaches_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


async def test_bypassing_process_over_its_memory_limit_is_killed_after_the_grace_period(
    env, nc, buckets
):
    """A plain process (the loader-copy bypass: libvgpu never ran, its region stays empty)
    holds 1500 MiB under a 1000 MiB limit: killed once the grace period has passed."""
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="kill") as rig:
        pod_uid, _region = await admit(rig, "greedy", 1000)
        tenant = env.spawn_in_pod(pod_uid)
        neighbour_uid, _ = await admit(rig, "polite", 1000)
        neighbour = env.spawn_in_pod(neighbour_uid)
        env.gpu_holds((0, tenant, 1500, 0), (0, neighbour, 200, 0))
        started = time.monotonic()
        elapsed = await wait_exit(tenant, timeout=GRACE_S + 10)
        assert elapsed is not None, "the process over its limit was not killed"
        assert elapsed >= GRACE_S - 0.1, f"killed after {elapsed:.2f}s, before the grace period"
        events = {}
        while set(events) != {"memory", "tampered"}:
            event = await breaches.next()
            events[event.breach] = event
        memory = events["memory"]
        assert (memory.pod_uid, memory.namespace, memory.pod, memory.container) == (
            pod_uid, "team", "greedy", "main")
        assert memory.device_uuid == rig.gpus[0] and memory.unit == "bytes"
        assert memory.limit == 1000 * MIB and memory.seen == 1500 * MIB
        assert memory.region_claim is None  # libvgpu never wrote the region
        assert memory.policy == "kill" and memory.action == "killed"
        assert memory.pids == [tenant.pid]
        assert memory.since <= time.time() - GRACE_S + 0.5
        assert events["tampered"].action == "observed"  # reported, never a reason to kill alone
        # the neighbour within its limit is untouched
        assert neighbour.poll() is None
        print(f"bypass killed {elapsed:.2f}s after it appeared (grace {GRACE_S}s, poll 0.5s)")
        assert time.monotonic() - started < GRACE_S + 10
    await breaches.close()


async def test_observe_reports_the_breach_and_counts_it_but_kills_nothing(env, nc, buckets):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="observe") as rig:
        pod_uid, _ = await admit(rig, "watched", 1000, gpu=1)
        tenant = env.spawn_in_pod(pod_uid)
        env.gpu_holds((1, tenant, 2000, 0))
        event = await breaches.next()
        while event.breach != "memory":
            event = await breaches.next()
        assert event.action == "observed" and event.policy == "observe"
        assert event.device_uuid == rig.gpus[1] and event.seen == 2000 * MIB
        # published once per episode, and the process lives on
        assert await breaches.none_within(2.0) or all(
            e.breach != "memory" for e in breaches.seen[1:])
        assert tenant.poll() is None
    assert breach_counter(breaches.seen, "memory") == 1
    await breaches.close()


async def test_short_spikes_within_the_grace_period_are_tolerated(env, nc, buckets):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="kill") as rig:
        pod_uid, _region = await admit(rig, "spiky", 1000)
        tenant = env.spawn_in_pod(pod_uid)
        stats = rig.agent.watchdog.stats

        async def seen_by_a_poll() -> None:
            """Two polls more: the second one gathered after the change (a fixed sleep could
            pass with no poll at all when a busy host holds the watchdog's thread up)."""
            polls, deadline = stats["polls"], time.monotonic() + 20
            while stats["polls"] < polls + 2:
                assert time.monotonic() < deadline, f"the watchdog stopped polling: {stats}"
                await asyncio.sleep(0.05)

        for _ in range(3):  # each spike lasts one or two polls (0.6 s each), within the 2 s grace
            env.gpu_holds((0, tenant, 1600, 0))
            await seen_by_a_poll()
            env.gpu_holds((0, tenant, 100, 0))
            await seen_by_a_poll()
        assert tenant.poll() is None, "a spike shorter than the grace period was killed"
        assert all(e.breach != "memory" for e in breaches.seen)
        assert await breaches.none_within(0.5) or all(
            e.breach != "memory" for e in breaches.seen)
    await breaches.close()


async def test_compute_breach_is_judged_on_the_average_over_the_window(env, nc, buckets):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="observe",
                           watchdog_compute_window_s=3.0) as rig:
        # `force`: the limit holds whether or not a neighbour is busy (under `default` it is
        # in force only while the GPU is contended, and so is the watchdog's judgement)
        hot_uid, _ = await admit(rig, "hot", 4000, cores=30, core_policy="force")
        fair_uid, _ = await admit(rig, "fair", 4000, cores=30, core_policy="force")
        free_uid, _ = await admit(rig, "free", 4000, cores=30, gpu=1)  # default, alone
        hot, fair = env.spawn_in_pod(hot_uid), env.spawn_in_pod(fair_uid)
        free = env.spawn_in_pod(free_uid)
        started = time.monotonic()
        # fair: within 30 + 10 points; free: 90 % but no limit in force (uncontended region)
        env.gpu_holds((0, hot, 100, 55), (0, fair, 100, 38), (1, free, 100, 90))
        event = await breaches.next()
        assert time.monotonic() - started >= 3.0 - 0.1  # a whole window first
        assert event.breach == "compute" and event.pod_uid == hot_uid
        assert event.unit == "percent" and event.limit == 30 and 54 <= event.seen <= 56
        assert await breaches.none_within(2.0)  # fair never breaches
        assert hot.poll() is None  # observe
    await breaches.close()


async def test_a_region_claiming_less_than_nvml_shows_is_reported_as_tampered(
    env, nc, buckets, region_writer
):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="kill") as rig:
        liar_uid, liar_region = await admit(rig, "liar", 4000)
        honest_uid, honest_region = await admit(rig, "honest", 4000)
        liar, honest = env.spawn_in_pod(liar_uid), env.spawn_in_pod(honest_uid)
        gpu = rig.gpus[0]
        # libvgpu's region, zeroed by the tenant: it claims 10 MiB, the GPU shows 1200 MiB
        subprocess.run([str(region_writer), liar_region, gpu, str(10 * MIB), "0", "0"],
                       check=True)
        subprocess.run([str(region_writer), honest_region, gpu, str(1150 * MIB), "0", "0"],
                       check=True)
        env.gpu_holds((0, liar, 1200, 0), (0, honest, 1200, 0))
        event = await breaches.next()
        assert event.breach == "tampered" and event.pod_uid == liar_uid
        assert event.region_claim == 10 * MIB and event.seen == 1200 * MIB
        assert event.action == "observed"  # under its limit: reported, not killed
        assert await breaches.none_within(GRACE_S + 1)  # the honest one is never reported
        assert liar.poll() is None and honest.poll() is None
    await breaches.close()


async def test_processes_of_no_known_pod_are_left_alone(env, nc, buckets):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, enforcement="kill") as rig:
        await admit(rig, "someone", 1000)
        stranger = env.spawn_in_pod("0a1b2c3d-0000-4000-8000-000000000000")  # not on this node
        host = env.spawn("0::/system.slice/cuda-daemon.service\n")  # not a pod at all
        ghost = env.spawn(None)  # no /proc entry readable
        env.gpu_holds((0, stranger, 15000, 100), (0, host, 15000, 100), (0, ghost, 15000, 100))
        assert await breaches.none_within(GRACE_S + 2)
        assert stranger.poll() is None and host.poll() is None and ghost.poll() is None
        stats = rig.agent.watchdog.stats
        assert stats["unattributed"] >= 3 and stats["poll_failed"] == 0
    await breaches.close()


def test_a_kill_is_refused_when_the_pid_no_longer_belongs_to_the_pod(env):
    """Between the poll and the kill a pid may be recycled or the process moved: the pod is
    checked again through a pidfd, and only then is the signal sent."""
    from tessera.node_agent.watchdog_host import end_process

    pod_uid = "11111111-2222-4333-8444-555555555555"
    mine = env.spawn_in_pod(pod_uid)
    other = env.spawn_in_pod("99999999-2222-4333-8444-555555555555")
    assert not end_process(env.proc_root, other.pid, pod_uid)
    assert not end_process(env.proc_root, 1, pod_uid)  # never init
    assert other.poll() is None
    assert end_process(env.proc_root, mine.pid, pod_uid)
    assert mine.wait(5) == -9
    assert not end_process(env.proc_root, mine.pid, pod_uid)  # gone: nothing to end


def test_a_region_replaced_by_a_fifo_or_a_symlink_claims_nothing_and_never_blocks(env):
    """The region directory is the tenant's: whatever it puts there, the watchdog reads a
    plain file or nothing (a FIFO would block an ordinary open forever)."""
    import os

    from tessera.node_agent.watchdog_host import RegionClaims

    claims = RegionClaims()
    fifo = env.base / "fifo-region"
    os.mkfifo(fifo)
    link = env.base / "link-region"
    link.symlink_to("/etc/passwd")
    started = time.monotonic()
    assert claims.read(str(fifo), 0.0) is None
    assert claims.read(str(link), 0.0) is None
    assert claims.read(str(env.base / "absent"), 0.0) is None
    assert time.monotonic() - started < 2
