"""A released event the ledger contradicts (forged with the right identity) does not drop a
running pod's quota charge; a true one does (real NATS, the real quota service)."""

from __future__ import annotations

import uuid

from quota_testkit import call, eventually, unique_namespace

from tessera import bus
from tessera.codec import decode, encode
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    NodeLedger,
    QuotaRequest,
    QuotaStatusRequest,
    ValueRejectedEvent,
)


async def charges(nc, ns: str) -> set[str]:  # type: ignore[no-untyped-def]
    reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    return set(reply.states[0].charges) if reply.states else set()


async def test_a_contradicted_release_keeps_the_charge(start_quota, nc, buckets) -> None:
    await start_quota()
    ns, node, uid = unique_namespace(), f"node-{uuid.uuid4().hex[:8]}", "running-pod"
    assert (await call(nc, bus.QUOTA_RESERVE, QuotaRequest(
        namespace=ns, pod_uid=uid, name="train", memory_mib=1000, cores=10, gpus=1))).ok
    running = Allocation(
        pod_uid=uid, namespace=ns, name="train", node=node, state=AllocationState.ALLOCATED,
        containers=[[DeviceGrant(uuid="GPU-a", type="NVIDIA-A10", memory_mib=1000, cores=10)]],
        quota_held=True,
    )  # fmt: skip
    await buckets.ledger.put(node, encode(NodeLedger(node=node, allocations={uid: running})))
    sub = await nc.subscribe(bus.rejected_event_subject("event"))
    await bus.publish_event(nc.jetstream(), AllocationEvent(
        action="released", node=node, pod_uid=uid, namespace=ns, name="train"))
    rejected = decode((await sub.next_msg(timeout=10)).data, ValueRejectedEvent)
    assert rejected.problem == "release_contradicted" and uid in rejected.reason
    assert await charges(nc, ns) == {uid}
    # The pod really ends: the ledger no longer holds it, and the release frees the charge.
    await buckets.ledger.put(node, encode(NodeLedger(node=node)))
    await bus.publish_event(nc.jetstream(), AllocationEvent(
        action="released", node=node, pod_uid=uid, namespace=ns, name="train"))

    async def freed() -> bool:
        return await charges(nc, ns) == set()

    await eventually(freed, timeout=10)
