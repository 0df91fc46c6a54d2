"""Scheduler replicas wired to the session NATS server and an in-memory cluster."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from tessera.scheduler.config import SchedulerSettings
from tessera.scheduler.runtime import SchedulerService

from tessera import bus
from tessera.bus import Buckets, BusKeeper, connect, ensure_bus
from tessera.clock import ServerClock
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import encode
from tessera.models import AllocationState, NodeLedger, NodeRegistration
from tessera.settings import NatsSettings, TesseraSettings

MakeService = Callable[..., Awaitable[SchedulerService]]


@pytest.fixture
def cluster() -> InMemoryCluster:
    # Node names the tests register on the bus exist in the cluster, unlabelled and untainted.
    return InMemoryCluster(implicit_nodes=True)


STOP_S = 30.0  # a replica stops in well under a second; 30 s: a loaded machine


@pytest.fixture
async def make_service(nats_url: str, cluster: InMemoryCluster) -> AsyncIterator[MakeService]:
    """Start scheduler replicas (each with its own NATS connection); all stopped at teardown."""
    started: list[tuple[SchedulerService, Any]] = []
    upkeep: list[asyncio.Task[None]] = []
    stop = asyncio.Event()

    async def make(
        settings: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        with_cluster: bool = True,
        clock: Callable[[], float] | None = None,
        keeper: bool = False,
        url: str | None = None,
    ) -> SchedulerService:
        """`clock`: a tessera.clock.ServerClock is kept measured for the replica's life."""
        tessera_settings = TesseraSettings(**{"quota_enabled": False, **(settings or {})})
        nc = await connect(NatsSettings(NATS_URL=url or nats_url), name="scheduler-test")
        js = nc.jetstream()
        buckets = await ensure_bus(js, tessera_settings)
        instance = f"test-{uuid.uuid4().hex[:6]}"
        bus_keeper = BusKeeper(js, tessera_settings) if keeper else None
        if bus_keeper is not None:
            assert await bus_keeper.check()  # what the service starts on (as service.serve)
        service = SchedulerService(
            tessera_settings,
            SchedulerSettings(**{"sweep_interval_s": 0.2, **(config or {})}),
            nc, js, buckets, cluster if with_cluster else None,
            instance=instance, clock=clock or time.time, keeper=bus_keeper,
        )  # fmt: skip
        if isinstance(clock, ServerClock):
            upkeep.append(asyncio.create_task(clock.run(js, instance, stop, 0.5)))
        if bus_keeper is not None:
            upkeep.append(asyncio.create_task(bus_keeper.run(stop, 0.2)))
        await service.start()
        await service.wait_ready(30)
        started.append((service, nc))
        return service

    yield make
    stop.set()
    for task in upkeep:
        task.cancel()
    hung = []
    for service, nc in started:
        # Bounded: a replica whose loop swallows its cancellation would otherwise hang the whole
        # run (pytest-timeout's own exception is swallowed by the same code). Closing its NATS
        # connection ends what it waits for; the test then fails, naming the replica.
        stopping = asyncio.ensure_future(service.stop())
        done, _ = await asyncio.wait({stopping}, timeout=STOP_S)
        await nc.close()
        if not done:
            hung.append(service.instance)
            await asyncio.wait({stopping}, timeout=STOP_S)
    assert not hung, f"scheduler replicas {hung} did not stop within {STOP_S} s"


def http_client(service: SchedulerService) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=service.app()), base_url="http://scheduler"
    )


async def register(buckets: Buckets, registration: NodeRegistration) -> None:
    await buckets.nodes.put(registration.node, encode(registration))


# Background effects (watch events, sweeps, KV writes) on a busy 2-core CI host can take
# seconds; the waits below return as soon as their condition holds, so a generous deadline
# costs nothing when the code is right.
WAIT_S = 20.0


async def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached in {timeout:.0f} s")
        await asyncio.sleep(0.01)


async def until_async(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT_S,
    interval: float = 0.05,
) -> None:
    """Await `check` until it holds, failing with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:.0f} s")
        await asyncio.sleep(interval)


async def agent_allocate(buckets: Buckets, node: str, uid: str) -> None:
    """What the node agent does in Allocate: mark allocated, release the claim."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        assert current is not None
        allocation = current.allocations.get(uid)
        if allocation is not None and allocation.state in (
            AllocationState.RESERVED, AllocationState.BOUND  # (as handshake.finish_mutation)
        ):
            allocation.state = AllocationState.ALLOCATED
        current.claims.pop(uid, None)
        return current

    await bus.cas_update(buckets.ledger, node, NodeLedger, mutate)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
