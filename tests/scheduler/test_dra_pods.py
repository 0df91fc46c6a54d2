"""DRA pods in the scheduler's ledger (issue 31): kube-scheduler's allocator places them and
Tessera's DRA driver records them (ledger entry `reason: dra`, quota held by the driver). When
such a pod is deleted its entry, its quota charge and a `released` event must follow within
seconds, as for an extender pod; and a scheduler restarted over a lost ledger must not give the
card a DRA pod holds to an extender pod."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tessera.node_agent.dra.accounting import DRA_REASON, put_mutation
from tessera.node_agent.dra.quota import DraQuota
from tessera.quota import QuotaService

from tessera import bus
from tessera.bus import Buckets, connect
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import WatchEvent
from tessera.codec import decode, encode
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.settings import NatsSettings, TesseraSettings

from .conftest import MakeService, http_client, register, unique, wait_until
from .factories import GIB, container, node, pod

DRA_MODE = {"tessera.io/allocation-mode": "dra"}


class SlowNodeListing(InMemoryCluster):
    """The in-memory cluster whose Node listing arrives only once `listing` is set (a large
    cluster's list of nodes takes a while)."""

    def __init__(self) -> None:
        super().__init__(implicit_nodes=True)
        self.listing = asyncio.Event()
        self.listing.set()

    async def watch_nodes_marked(self) -> AsyncIterator[WatchEvent | None]:
        await self.listing.wait()
        async for event in super().watch_nodes_marked():
            yield event


@pytest.fixture
def cluster() -> SlowNodeListing:
    return SlowNodeListing()


def dra_pod(namespace: str, node_name: str) -> dict[str, Any]:
    """A running pod whose GPU comes from a ResourceClaim (no HAMi annotations)."""
    return {
        "metadata": {"name": unique("dra"), "namespace": namespace},
        "spec": {
            "nodeName": node_name,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "slice"}],
            "containers": [{"name": "main", "image": "cuda:12",
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
        "status": {"phase": "Running"},
    }


def dra_allocation(spec: dict[str, Any], node_name: str, card: str) -> Allocation:
    """What Tessera's DRA driver writes when it prepares the pod's claim."""
    meta = spec["metadata"]
    return Allocation(
        pod_uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], node=node_name,
        containers=[[DeviceGrant(uuid=card, type="NVIDIA-H100", memory_mib=4096, cores=30)]],
        state=AllocationState.ALLOCATED, reason=DRA_REASON, quota_held=True,
        container_names=["main"],
    )  # fmt: skip


async def read_ledger(buckets: Buckets, name: str) -> NodeLedger | None:
    entry = await bus.read(buckets.ledger, name, NodeLedger)
    return entry.value if entry is not None else None


async def test_a_deleted_dra_pod_releases_its_entry_quota_and_announces_it(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any,
    nats_url: str,
) -> None:
    quota_nc = await connect(NatsSettings(NATS_URL=nats_url), name="quota-under-test")
    quota = QuotaService(quota_nc, buckets, TesseraSettings(),
                         consumer=f"quota-test-{uuid.uuid4().hex[:8]}")  # fmt: skip
    await quota.start()
    try:
        service = await make_service({"quota_enabled": True})
        registration = node(unique("n"), gpus=1, memory_mib=16 * GIB)
        name = registration.node
        cluster.add_node({"metadata": {"name": name, "annotations": dict(DRA_MODE)}})
        await register(buckets, registration)
        await wait_until(lambda: service.index.node(name) is not None)
        namespace = unique("q")
        reply = await nc.request(bus.QUOTA_SET, encode(QuotaSetRequest(
            namespace=namespace, limits=QuotaAmount(memory_mib=6000))), timeout=5)  # fmt: skip
        assert decode(reply.data, QuotaReply).ok

        async def used() -> int:
            msg = await nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest(
                namespace=namespace)), timeout=5)  # fmt: skip
            [state] = decode(msg.data, QuotaReply).states
            return state.used().memory_mib or 0

        spec = cluster.add_pod(dra_pod(namespace, name))
        uid = spec["metadata"]["uid"]
        allocation = dra_allocation(spec, name, registration.devices[0].uuid)
        # the driver's prepare: the charge held, then the ledger entry
        await DraQuota(nc, TesseraSettings()).hold(namespace, uid, spec["metadata"]["name"],
                                                   allocation)  # fmt: skip
        await bus.cas_update(buckets.ledger, name, NodeLedger, put_mutation(name, allocation))
        await wait_until(lambda: service.index.pod_nodes.get(uid) == name)
        assert await used() == 4096
        released = await nc.subscribe(bus.alloc_event_subject(name, "released"))
        await bus.flush(nc)  # in place before another connection publishes

        cluster.delete_pod(namespace, spec["metadata"]["name"])  # kubelet unprepares later
        event = decode((await released.next_msg(timeout=10)).data, AllocationEvent)
        assert (event.pod_uid, event.action) == (uid, "released")
        for _ in range(200):
            current = await read_ledger(buckets, name)
            if current is None or uid not in current.allocations:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the deleted DRA pod is still in the ledger")
        for _ in range(200):
            if await used() == 0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the deleted DRA pod's quota charge was not released")
    finally:
        await quota.stop()
        await quota_nc.drain()


async def test_a_restarted_scheduler_over_a_lost_ledger_gives_no_dra_card_away(
    make_service: MakeService, buckets: Buckets, cluster: SlowNodeListing
) -> None:
    """The ledger is lost (its bucket key deleted) while a DRA pod holds the node's only card;
    a scheduler started afterwards refuses an extender pod there (the rebuild reads no HAMi
    annotations on a DRA pod, so nothing in the ledger says the card is taken: the node's DRA
    mode does), also when the Node listing is slow (not ready until it is applied)."""
    registration = node(unique("n"), gpus=1, memory_mib=16 * GIB)
    name = registration.node
    cluster.add_node({"metadata": {"name": name, "annotations": dict(DRA_MODE)}})
    await register(buckets, registration)
    spec = cluster.add_pod(dra_pod("default", name))
    allocation = dra_allocation(spec, name, registration.devices[0].uuid)
    await bus.cas_update(buckets.ledger, name, NodeLedger, put_mutation(name, allocation))
    await buckets.ledger.delete(name)  # NATS lost the node's ledger

    cluster.listing.clear()  # the Node listing is slow: the scheduler must wait for it

    async def list_later() -> None:
        await asyncio.sleep(1.0)
        cluster.listing.set()

    later = asyncio.create_task(list_later())
    service = await make_service()  # starts (and rebuilds) over the lost ledger
    assert cluster.listing.is_set()  # not ready before the nodes' modes were known
    await later
    await wait_until(lambda: service.index.node(name) is not None)
    wanted = cluster.add_pod(pod(container(mem=12 * GIB)))
    async with http_client(service) as client:
        response = await client.post("/filter", json={"pod": wanted, "nodenames": [name]})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert not answer.get("nodenames"), answer
    assert "DRA" in str(answer.get("failedNodes") or answer.get("error")), answer
    current = await read_ledger(buckets, name)
    assert current is None or wanted["metadata"]["uid"] not in current.allocations
