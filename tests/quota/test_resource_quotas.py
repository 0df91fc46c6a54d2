"""Limits from Kubernetes ResourceQuota objects, watched through the cluster port."""

from __future__ import annotations

import asyncio
import logging

from quota_testkit import call, eventually, unique_namespace
from tessera.quota.resource_quotas import ResourceQuotaWatcher

from tessera import bus
from tessera.cluster.memory import InMemoryCluster
from tessera.models import (
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaState,
    QuotaStatusRequest,
)
from tessera.settings import TesseraSettings


def resource_quota(ns: str, name: str, hard: dict[str, object]) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
            "spec": {"hard": hard}}


async def limits_of(nc, ns: str) -> QuotaAmount | None:
    reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    return reply.states[0].limits if isinstance(reply, QuotaReply) else None


async def test_resource_quotas_set_the_namespace_limits_and_follow_changes(start_quota, nc):
    cluster = InMemoryCluster()
    ns = unique_namespace()
    cluster.put_quota(resource_quota(ns, "gpu", {
        "limits.nvidia.com/gpumem": "4000", "limits.nvidia.com/gpucores": "200",
        "requests.nvidia.com/gpu": "2", "pods": "20",
    }))
    await start_quota(cluster=cluster)
    expected = QuotaAmount(memory_mib=4000, cores=200, gpus=2)

    def limits_are(want: QuotaAmount):
        async def check() -> bool:
            return await limits_of(nc, ns) == want
        return check

    await eventually(limits_are(expected))
    reply = await call(nc, bus.QUOTA_RESERVE, QuotaRequest(
        namespace=ns, pod_uid="p1", memory_mib=4001, cores=10, gpus=1, check_only=True))
    assert not reply.ok and "gpumem" in reply.reason

    # The object is edited: the new limit replaces the old one in one write.
    cluster.put_quota(resource_quota(ns, "gpu", {"limits.nvidia.com/gpumem": "8000"}))
    await eventually(limits_are(QuotaAmount(memory_mib=8000)))
    # A second, tighter object in the same namespace: both apply, the smallest wins.
    cluster.put_quota(resource_quota(ns, "team-cap", {"limits.nvidia.com/gpumem": "6000",
                                                      "limits.nvidia.com/gpu": "1"}))
    await eventually(limits_are(QuotaAmount(memory_mib=6000, gpus=1)))
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert status.states[0].source == "resourcequota/gpu,team-cap"


async def test_configured_resource_names_and_malformed_values(start_quota, nc):
    cluster = InMemoryCluster()
    ns = unique_namespace()
    settings = TesseraSettings(resource_mem="example.com/vmem", resource_name="example.com/vgpu")
    await start_quota(settings, cluster=cluster)
    cluster.put_quota(resource_quota(ns, "q", {
        "limits.example.com/vmem": "lots",  # malformed: reported, not applied
        "limits.example.com/vgpu": "3",
        "limits.nvidia.com/gpumem": "10",  # not the configured name here
    }))

    async def applied() -> bool:
        return await limits_of(nc, ns) == QuotaAmount(gpus=3)

    await eventually(applied)
    assert any(e["reason"] == "InvalidGPUQuota" and "vmem" in e["message"]
               for e in cluster.events)


async def test_deleting_the_last_resource_quota_makes_the_namespace_unlimited():
    """The watcher's own bookkeeping (InMemoryCluster has no delete helper for quotas)."""
    applied: list[tuple[str, dict]] = []

    async def apply(namespace: str, quotas: dict) -> None:
        applied.append((namespace, quotas))

    watcher = ResourceQuotaWatcher(InMemoryCluster(), TesseraSettings(), apply,
                                   logging.getLogger("test"))
    rq = resource_quota("team-a", "gpu", {"limits.nvidia.com/gpumem": "100"})
    await watcher.handle("ADDED", rq)
    await watcher.handle("ADDED", resource_quota("team-a", "cpu-only", {"limits.cpu": "4"}))
    assert applied[-1] == ("team-a", {"gpu": QuotaAmount(memory_mib=100)})
    await watcher.handle("DELETED", rq)
    assert applied[-1] == ("team-a", {})
    assert "team-a" not in watcher.known


async def test_limits_of_resource_quotas_deleted_while_the_service_was_down_are_lifted(
    start_quota, nc, buckets
):
    gone, by_hand = unique_namespace("gone"), unique_namespace("cli")
    stale = QuotaState(namespace=gone, limits=QuotaAmount(gpus=1), source="resourcequota/old")
    await bus.cas_update(buckets.quota, gone, QuotaState, lambda _s: stale)
    manual = QuotaState(namespace=by_hand, limits=QuotaAmount(gpus=1), source="cli")
    await bus.cas_update(buckets.quota, by_hand, QuotaState, lambda _s: manual)

    await start_quota(cluster=InMemoryCluster())  # the cluster has no ResourceQuota any more

    async def lifted() -> bool:
        return await limits_of(nc, gone) == QuotaAmount()

    await eventually(lifted)
    assert await limits_of(nc, by_hand) == QuotaAmount(gpus=1)  # set by hand: left alone


async def test_the_watch_ends_once_stopped_even_if_its_cancellation_is_lost():
    """The quota service's stop sets the stop event, then cancels and awaits its tasks. A cancel
    landing just as a bus reply arrives is swallowed by `asyncio.wait_for` (Python 3.11, inside
    nats-py's request, which applying limits makes), so the watch must end on the stop event
    alone. Before, it waited for its next cluster event forever and the service's stop hung
    (seen as a 300 s teardown timeout of this module beside busy CPUs)."""
    applied: list[str] = []

    async def apply(namespace: str, quotas: dict) -> None:
        applied.append(namespace)

    cluster = InMemoryCluster()
    cluster.put_quota(resource_quota("team-a", "gpu", {"limits.nvidia.com/gpumem": "100"}))
    watcher = ResourceQuotaWatcher(cluster, TesseraSettings(), apply, logging.getLogger("test"),
                                   settle_s=0.05)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))

    async def listed() -> bool:
        return "team-a" in applied

    await eventually(listed, timeout=10)  # past the listing: waiting for the next event
    stop.set()  # no cancel
    await asyncio.wait_for(task, 10)
