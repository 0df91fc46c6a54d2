"""Kill a scheduler mid-burst, start another: the index rebuilds from NATS, the ledger stays
consistent, and no stale reservation or claim survives its expiry."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from tessera.scheduler.cards import build_cards, over_capacity

from tessera import bus
from tessera.bus import Buckets
from tessera.cancelling import cancel_and_wait
from tessera.cluster.memory import InMemoryCluster
from tessera.models import AllocationState, NodeLedger

from .conftest import MakeService, agent_allocate, register, unique, until_async, wait_until
from .factories import GIB, container, node, pod

TTL = 1.0


async def burst(service: Any, cluster: InMemoryCluster, names: list[str], buckets: Buckets,
                rng: random.Random, dangling: set[str] | None = None) -> None:  # fmt: skip
    spec = cluster.add_pod(pod(container(mem=rng.randint(1, 20) * GIB, cores=rng.choice([0, 20]))))
    meta = spec["metadata"]
    outcome = await service.scheduler.filter(spec, names)
    if outcome.nodenames:
        node_name = outcome.nodenames[0]
        if rng.random() < 0.25:
            if dangling is not None:
                dangling.add(meta["uid"])
            return  # kube-scheduler gave up between filter and bind: the reservation dangles
        error = await service.scheduler.bind(meta["namespace"], meta["name"], meta["uid"],
                                             node_name)  # fmt: skip
        if not error and rng.random() < 0.5:
            await agent_allocate(buckets, node_name, meta["uid"])


async def test_restart_rebuilds_index_and_expires_stale_reservations(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    rng = random.Random(7)
    timing = {"reservation_ttl_s": TTL}
    first = await make_service(timing, {"claim_ttl_s": TTL, "bind_timeout_s": 0.5})
    registrations = {}
    for _ in range(3):
        registration = node(unique("r"), gpus=2, memory_mib=80 * GIB)
        registrations[registration.node] = registration
        await register(buckets, registration)
    names = list(registrations)
    await wait_until(lambda: all(first.index.node(n) for n in names))

    gate = asyncio.Semaphore(16)
    dangling: set[str] = set()  # pods kube-scheduler gave up on after the filter

    async def gated() -> None:
        async with gate:
            await burst(first, cluster, names, buckets, rng, dangling)

    def dangling_reservation_with_time_left() -> bool:
        # Only the replica's own sweep could end such a reservation, and not before it lapses:
        # crashing now leaves it behind however slowly a loaded machine ran the burst so far.
        soon = time.time() + TTL / 2
        return any(
            uid in dangling and a.state == AllocationState.RESERVED
            and a.expires_at is not None and a.expires_at > soon
            for e in first.index.entries.values() if e.ledger
            for uid, a in e.ledger.allocations.items()
        )  # fmt: skip

    tasks = [asyncio.create_task(gated()) for _ in range(200)]
    await wait_until(dangling_reservation_with_time_left, 30)
    # The crash: the replica's loops and every request in flight die where they stand.
    first.kill()
    await cancel_and_wait(tasks)  # (a cancel landing with a bus reply may be dropped: re-sent)
    await first.nc.close()
    left_reserved = 0
    for name in names:
        entry = await bus.read(buckets.ledger, name, NodeLedger)
        allocations = entry.value.allocations.values() if entry else []
        left_reserved += sum(a.state == AllocationState.RESERVED for a in allocations)
    assert left_reserved > 0  # the crash really left reservations behind

    second = await make_service(timing, {"claim_ttl_s": TTL})
    # The new index equals what the ledger says, node by node.
    for name, registration in registrations.items():
        entry = await bus.read(buckets.ledger, name, NodeLedger)
        if entry is None:
            continue
        now = time.time()
        expected = build_cards(registration, entry.value.allocations.values(), now)
        await wait_until(lambda n=name, r=entry.revision: second.index.entries[n].ledger_revision
                         >= r)  # fmt: skip
        if second.index.entries[name].ledger_revision == entry.revision:
            got = second.index.node(name).cards
            assert [(c.used_mem, c.used_slots) for c in got] == [
                (c.used_mem, c.used_slots) for c in expected
            ]
        assert over_capacity(build_cards(registration, entry.value.allocations.values(), 0)) == []

    # After the TTL no reservation or claim is left over; what stays is bound in the cluster.
    await asyncio.sleep(TTL + 0.6)

    async def settled() -> bool:
        for name in names:
            entry = await bus.read(buckets.ledger, name, NodeLedger)
            if entry is None:
                continue
            value = entry.value
            if any(c.expires_at <= time.time() for c in value.in_flight().values()):
                return False
            if any(a.state == AllocationState.RESERVED for a in value.allocations.values()):
                return False
        return True

    await until_async(settled, "every lapsed reservation and claim dropped", interval=0.1)
    bound_in_cluster = {
        p["metadata"]["uid"]: p["spec"].get("nodeName") for p in cluster.pods.values()
    }
    for name in names:
        entry = await bus.read(buckets.ledger, name, NodeLedger)
        for uid, allocation in (entry.value.allocations if entry else {}).items():
            assert bound_in_cluster.get(uid) == name, f"{uid} holds {name} but is not bound there"
            assert allocation.state in (AllocationState.BOUND, AllocationState.ALLOCATED)

    # And the new replica schedules on the same nodes.
    spec: dict[str, Any] = cluster.add_pod(pod(container(mem=1 * GIB)))
    outcome = await second.scheduler.filter(spec, names)
    assert outcome.nodenames, outcome.failed
    meta = spec["metadata"]
    assert await second.scheduler.bind(meta["namespace"], meta["name"], meta["uid"],
                                       outcome.nodenames[0]) == ""  # fmt: skip
