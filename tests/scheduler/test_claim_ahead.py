"""A filter's reservation also takes the pod's in-flight claim when its bind could take it at
once (ledger.ClaimAhead): one ledger write fewer per pod, and never a claim the bind would not
have been given. Against the real NATS ledger (writes to the node's key counted) and an in-memory
cluster."""

from __future__ import annotations

import asyncio
from typing import Any

from tessera import bus
from tessera.models import AllocationState

from .conftest import MakeService, agent_allocate, http_client
from .factories import GIB, container, node, pod
from .test_extender import bind_call, filter_call, ledger, setup_node, unique


class KeyWrites:
    """Every write to one node's ledger entry while open, seen on the key's own subject.

    Not the entry's revision: a KV revision is the bucket's stream sequence, shared by every key
    (and every test on the session's NATS server), so another node's write in between (a
    reconcile releasing an earlier test's leftovers, seen in a loaded CI run) moved it by two."""

    def __init__(self, nc: Any, name: str) -> None:
        self.nc, self.subject, self.count = nc, f"$KV.{bus.LEDGER_BUCKET}.{name}", 0

    async def __aenter__(self) -> KeyWrites:
        async def seen(_msg: Any) -> None:
            self.count += 1

        self.sub = await self.nc.subscribe(self.subject, cb=seen)
        await bus.flush(self.nc)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.sub.unsubscribe()

    async def settled(self, expected: int, within_s: float = 20.0) -> int:
        """The count once `expected` writes have arrived (or `within_s` passed) and a round trip
        more."""
        deadline = asyncio.get_running_loop().time() + within_s
        while self.count < expected and asyncio.get_running_loop().time() < deadline:
            await self.nc.flush()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # room for an unexpected extra write to show itself
        await self.nc.flush()
        return self.count


async def test_idle_node_filter_claims_and_bind_writes_nothing(
    make_service: MakeService, buckets: Any, cluster: Any, nc: Any
) -> None:
    """The filter's one write reserves and claims; the bind writes nothing (the `bound` mark
    is left to the agent's Allocate, binding.PodBinder._leave_mark); with no Allocate, the
    sweeper marks it bound once the claim is `orphaned_bind_s` old."""
    service = await make_service({"reservation_ttl_s": 20},
                                 {"claim_ttl_s": 30, "orphaned_bind_s": 4.0})  # fmt: skip
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    spec = cluster.add_pod(pod(container(mem=2 * GIB, cores=10)))
    uid = spec["metadata"]["uid"]
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        state = await ledger(buckets, name)
        # One write: reserved and in flight, its expiry the reservation's own (not extended).
        assert state.allocations[uid].state == AllocationState.RESERVED
        assert set(state.claims) == {uid} and state.claims[uid].holder == service.instance
        claim = state.claims[uid]
        assert state.allocations[uid].expires_at == claim.taken_at + 20
        assert claim.expires_at == claim.taken_at + 30
        async with KeyWrites(nc, name) as writes:
            assert await bind_call(client, spec, name) == ""
            bound_at = asyncio.get_running_loop().time()
            assert await writes.settled(0) == 0  # no claim write, no bound mark
        assert cluster.pods[("default", spec["metadata"]["name"])]["spec"]["nodeName"] == name
        state = await ledger(buckets, name)
        assert state.allocations[uid].state == AllocationState.RESERVED
        assert set(state.claims) == {uid}
        async with KeyWrites(nc, name) as writes:
            # the sweeper's mark: no Allocate came
            assert await writes.settled(1, within_s=15.0) == 1
        assert asyncio.get_running_loop().time() - bound_at < 15
    state = await ledger(buckets, name)
    held = state.allocations[uid]
    assert held.state == AllocationState.BOUND and held.expires_at is None
    assert set(state.claims) == {uid}  # still in flight: its Allocate may come
    assert service.scheduler.releaser.bound_unmarked == {}


async def test_no_claim_ahead_beside_a_competitor_in_flight_or_waiting(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """A pod of another layout with the same first device count: in flight (first) or reserved
    and waiting to bind (third, behind the second): later filters take no claim, and the binds
    go in the order the in-flight rules give them."""
    service = await make_service(config={"bind_timeout_s": 5.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    on = {n: {"nvidia.com/use-gpuuuid": f"GPU-{name}-{n}"} for n in (0, 1)}
    first = cluster.add_pod(pod(container(mem=GIB), annotations=on[0]))
    other = cluster.add_pod(pod(container("x", mem=GIB), container("y", mem=GIB),
                                annotations=on[1]))  # fmt: skip
    same = cluster.add_pod(pod(container(mem=GIB), annotations=on[0]))
    async with http_client(service) as client:
        assert (await filter_call(client, first, [name]))["nodenames"] == [name]
        assert (await filter_call(client, other, [name]))["nodenames"] == [name]
        assert (await filter_call(client, same, [name]))["nodenames"] == [name]
        state = await ledger(buckets, name)
        # `other` competes with `first` (in flight); `same` would compete with `other`, which
        # is reserved and will bind first.
        assert set(state.claims) == {first["metadata"]["uid"]}
        assert await bind_call(client, first, name) == ""
        waiting = asyncio.create_task(bind_call(client, other, name))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await agent_allocate(buckets, name, first["metadata"]["uid"])
        assert await asyncio.wait_for(waiting, 30) == ""
    assert set((await ledger(buckets, name)).claims) == {other["metadata"]["uid"]}


async def test_pods_of_one_shape_all_claim_ahead(
    make_service: MakeService, buckets: Any, cluster: Any, nc: Any
) -> None:
    """Interchangeable pods never compete: each filter puts its pod in flight, no bind
    writes (the bound marks are left to the Allocates), and none waits for an Allocate."""
    service = await make_service(config={"bind_timeout_s": 3.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=4))
    specs = [cluster.add_pod(pod(container(mem=2 * GIB, cores=10))) for _ in range(6)]
    async with http_client(service) as client:
        for spec in specs:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        async with KeyWrites(nc, name) as writes:
            assert await asyncio.gather(*(bind_call(client, s, name) for s in specs)) == [""] * 6
            assert await writes.settled(0) == 0
    assert set((await ledger(buckets, name)).claims) == {s["metadata"]["uid"] for s in specs}
    assert service.metrics.claim_waits._value.get() == 0


async def test_an_unbound_pods_claim_goes_with_its_reservation(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """kube-scheduler never binds: the reservation lapses at its own TTL and the claim taken
    ahead goes with it, so nothing is held back for the claim's longer TTL."""
    service = await make_service({"reservation_ttl_s": 0.4}, {"claim_ttl_s": 30})
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    spec = cluster.add_pod(pod(container(mem=1000)))
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
    assert set((await ledger(buckets, name)).claims) == {spec["metadata"]["uid"]}

    async def gone() -> bool:
        state = await ledger(buckets, name)
        return not state.allocations and not state.claims

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not await gone():
        assert loop.time() < deadline, "the lapsed reservation and its claim were not dropped"
        await asyncio.sleep(0.1)
