"""Fixtures for the quota service: replicas on the shared test server, and a client."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from tessera.quota import QuotaService

from tessera import bus
from tessera.bus import connect, ensure_bus
from tessera.settings import NatsSettings, TesseraSettings

StartQuota = Callable[..., Awaitable[QuotaService]]


@pytest.fixture
async def start_quota(nats_url: str) -> AsyncIterator[StartQuota]:
    """Start quota replicas, each with its own connection; all stopped and cleaned up after.

    Every test gets its own durable consumer name (shared by the replicas it starts), so tests
    on the shared server never consume each other's release events.
    """
    consumer = f"quota-test-{uuid.uuid4().hex[:8]}"
    started: list[tuple[QuotaService, NatsClient]] = []

    async def start(settings: TesseraSettings | None = None, **kwargs: Any) -> QuotaService:
        client = await connect(NatsSettings(NATS_URL=nats_url), name="quota-under-test")
        settings = settings or TesseraSettings()
        buckets = await ensure_bus(client.jetstream(), settings)
        kwargs.setdefault("consumer", consumer)
        service = QuotaService(client, buckets, settings, **kwargs)
        await service.start()
        started.append((service, client))
        return service

    yield start
    for service, client in started:
        await service.stop()
        if not client.is_closed:
            with contextlib.suppress(Exception):
                await client.jetstream().delete_consumer(bus.EVENTS_STREAM, consumer)
            await client.drain()
