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
    QuotaAmount,
    QuotaRequest,
    QuotaSetRequest,
    QuotaState,
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
    await bus.flush(nc)  # in place before another connection publishes
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


async def test_an_invalid_quota_record_refuses_reservations_until_limits_are_set(
    start_quota, nc, buckets
) -> None:
    await start_quota()
    ns = unique_namespace()
    # A decodable record with a negative limit (forged or corrupt): never used as is.
    await buckets.quota.put(ns, encode(QuotaState(
        namespace=ns, limits=QuotaAmount(memory_mib=-1000))))  # fmt: skip
    sub = await nc.subscribe(bus.rejected_event_subject("quota"))
    await bus.flush(nc)  # in place before another connection publishes
    ask = QuotaRequest(namespace=ns, pod_uid="p1", name="p1", memory_mib=100, cores=1, gpus=1)
    refused = await call(nc, bus.QUOTA_RESERVE, ask)
    assert not refused.ok and "quota record of namespace" in refused.reason
    rejected = decode((await sub.next_msg(timeout=5)).data, ValueRejectedEvent)
    assert rejected.problem == "quota_out_of_range"
    check = await call(nc, bus.QUOTA_RESERVE, ask.model_copy(update={"check_only": True}))
    assert not check.ok
    # Setting the limits again repairs the record; reservations work again.
    assert (await call(nc, bus.QUOTA_SET, QuotaSetRequest(
        namespace=ns, limits=QuotaAmount(memory_mib=4000)))).ok  # fmt: skip
    assert (await call(nc, bus.QUOTA_RESERVE, ask)).ok
