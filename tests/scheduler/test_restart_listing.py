"""A restarted scheduler's index holds exactly what the KV holds, its ledger entries' repeated
strings shared (interned) as they are read."""

from __future__ import annotations

import sys

from tessera.scheduler.wire_fast import LedgerWire

from tessera.bus import Buckets
from tessera.codec import decode, encode
from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger, NodeRegistration

from .conftest import MakeService, register, unique
from .factories import GIB, node


def ledger_of(registration: NodeRegistration, pods: int) -> NodeLedger:
    allocations = {}
    for i in range(pods):
        d = registration.devices[i % len(registration.devices)]
        uid = f"{registration.node}-pod{i}"
        grant = DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=GIB, cores=5)
        allocations[uid] = Allocation(
            pod_uid=uid, namespace=f"team-{i % 3}", name=uid, node=registration.node,
            containers=[[grant]], state=AllocationState.ALLOCATED,
        )  # fmt: skip
    return NodeLedger(node=registration.node, allocations=allocations)


async def test_restart_index_equals_the_kv_and_strings_are_shared(
    make_service: MakeService, buckets: Buckets
) -> None:
    registrations = [node(unique("ls"), gpus=2) for _ in range(6)]
    payloads = {}
    for registration in registrations:
        await register(buckets, registration)
        payload = encode(ledger_of(registration, 5))
        await buckets.ledger.put(registration.node, payload)
        payloads[registration.node] = payload
    # The pods exist only in the ledger here: not released as gone (stale.py), so that the index
    # can be compared with what the KV holds.
    service = await make_service(config={"release_missing_pods": False})  # ready: both listed
    views = {r.node: service.index.entries[r.node].view for r in registrations}
    assert all(type(v) is LedgerWire for v in views.values())  # read unbuilt at start-up
    for name, view in views.items():
        assert view.materialize() == decode(payloads[name], NodeLedger)  # exactly the KV's
        assert set(service.index.pod_nodes) >= set(view.allocations)
        for allocation in view.allocations.values():
            assert allocation.namespace is sys.intern(allocation.namespace)
            assert allocation.node is view.node
            grant = allocation.containers[0][0]
            assert grant.uuid is sys.intern(grant.uuid)
