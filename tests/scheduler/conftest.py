"""Scheduler replicas wired to the session NATS server and an in-memory cluster."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from tessera.scheduler.config import SchedulerSettings
from tessera.scheduler.runtime import SchedulerService

from tessera import bus
from tessera.bus import Buckets, connect, ensure_bus
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import encode
from tessera.models import AllocationState, NodeLedger, NodeRegistration
from tessera.settings import NatsSettings, TesseraSettings

MakeService = Callable[..., Awaitable[SchedulerService]]


@pytest.fixture
def cluster() -> InMemoryCluster:
    return InMemoryCluster()


@pytest.fixture
async def make_service(nats_url: str, cluster: InMemoryCluster) -> AsyncIterator[MakeService]:
    """Start scheduler replicas (each with its own NATS connection); all stopped at teardown."""
    started: list[tuple[SchedulerService, Any]] = []

    async def make(
        settings: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        with_cluster: bool = True,
    ) -> SchedulerService:
        tessera_settings = TesseraSettings(**{"quota_enabled": False, **(settings or {})})
        nc = await connect(NatsSettings(NATS_URL=nats_url), name="scheduler-test")
        js = nc.jetstream()
        buckets = await ensure_bus(js, tessera_settings)
        service = SchedulerService(
            tessera_settings,
            SchedulerSettings(**{"sweep_interval_s": 0.2, **(config or {})}),
            nc, js, buckets, cluster if with_cluster else None,
            instance=f"test-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip
        await service.start()
        await service.wait_ready(10)
        started.append((service, nc))
        return service

    yield make
    for service, nc in started:
        await service.stop()
        await nc.close()


def http_client(service: SchedulerService) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=service.app()), base_url="http://scheduler"
    )


async def register(buckets: Buckets, registration: NodeRegistration) -> None:
    await buckets.nodes.put(registration.node, encode(registration))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def agent_allocate(buckets: Buckets, node: str, uid: str) -> None:
    """What the node agent does in Allocate: mark allocated, release the claim."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        assert current is not None
        allocation = current.allocations.get(uid)
        if allocation is not None and allocation.state == AllocationState.BOUND:
            allocation.state = AllocationState.ALLOCATED
        current.claims.pop(uid, None)
        return current

    await bus.cas_update(buckets.ledger, node, NodeLedger, mutate)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
