"""Leases between replicas are judged on the NATS server's clock: a replica whose own clock runs
40 s ahead neither sweeps another replica's reservation early nor announces live nodes lost.

The control test runs the same skewed replica on its own local clock and sees both failures, so
the main test is known to be able to fail."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from tessera import bus
from tessera.bus import Buckets
from tessera.cancelling import cancel_and_wait
from tessera.clock import ServerClock
from tessera.cluster.memory import InMemoryCluster
from tessera.events import subscribe
from tessera.models import AllocationState, NodeLedger

from .conftest import MakeService, register, unique, wait_until
from .factories import GIB, container, node, pod

SKEW_S = 40.0
SETTINGS = {"node_ttl_s": 5.0, "reservation_ttl_s": 30.0}  # "node lost" after 10 s of silence


def skewed() -> float:
    return time.time() + SKEW_S


async def heartbeat(buckets: Buckets, name: str, stop: asyncio.Event) -> None:
    """The node agent: re-put the registration every 0.5 s, stamped with its own (true) clock."""
    while not stop.is_set():
        await register(buckets, node(name, gpus=2, memory_mib=10 * GIB))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_with_skewed_replica(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: object,
    skewed_clock: Callable[[], float], *, expect_broken: bool = False,
) -> tuple[bool, int]:  # fmt: skip
    """(is the reservation made by a true-clock replica still there after 3 s, or, for the
    control (`expect_broken`), once it is gone and a node.lost came or 20 s passed; how many
    node.lost events the skewed replica published for a heartbeating node)."""
    name = unique("skew")
    stop = asyncio.Event()
    beating = asyncio.create_task(heartbeat(buckets, name, stop))
    lost = subscribe(nc, bus.node_event_subject(name, "lost"))  # type: ignore[arg-type]
    announced: list[object] = []

    async def collect() -> None:
        async for received in lost:
            announced.append(received.event)

    collector = asyncio.create_task(collect())
    try:
        honest = await make_service(SETTINGS, clock=ServerClock())
        await wait_until(lambda: honest.index.node(name) is not None)
        spec = cluster.add_pod(pod(container(mem=GIB)))
        outcome = await honest.scheduler.filter(spec, [name])
        assert outcome.nodenames == [name]
        uid = spec["metadata"]["uid"]

        await make_service(SETTINGS, clock=skewed_clock)  # sweeps every 0.2 s

        async def reservation_kept() -> bool:
            entry = await bus.read(buckets.ledger, name, NodeLedger)
            allocation = entry.value.allocations.get(uid) if entry else None
            return allocation is not None and allocation.state == AllocationState.RESERVED

        if expect_broken:  # the control: wait (generously, on a busy host) for the damage
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0
            while (await reservation_kept() or not announced) and loop.time() < deadline:
                await asyncio.sleep(0.1)
        else:
            await asyncio.sleep(3.0)  # fifteen sweeps of the skewed replica: none may harm
        return await reservation_kept(), len(announced)
    finally:
        stop.set()
        await beating
        await cancel_and_wait(collector)  # (a cancel landing with a bus reply may be dropped)
        await lost.aclose()


async def test_skewed_replica_on_the_server_clock_keeps_leases(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: object
) -> None:
    clock = ServerClock(local=skewed)
    kept, lost = await run_with_skewed_replica(make_service, buckets, cluster, nc, clock)
    assert abs(clock.offset + SKEW_S) < 1.0, f"measured offset {clock.offset:.3f} s"
    assert kept, "the skewed replica swept another replica's reservation before its TTL"
    assert lost == 0, f"{lost} false node.lost events for a node that heartbeats"


async def test_control_a_skewed_local_clock_breaks_leases(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: object
) -> None:
    kept, lost = await run_with_skewed_replica(make_service, buckets, cluster, nc, skewed,
                                               expect_broken=True)  # fmt: skip
    assert not kept and lost >= 1
