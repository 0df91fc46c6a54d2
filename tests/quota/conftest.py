"""Fixtures for the quota service: replicas on the shared test server, and a client."""

from __future__ import annotations

import asyncio
import contextlib
import io
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
STOP_S = 20.0


def waiting_tasks() -> str:
    """Where every other task of the loop waits (a stop that hung says why)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.print_stack(limit=4, file=out)
    return out.getvalue()


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
    hung: list[str] = []
    for service, client in started:
        # Bounded: a task that lost its cancellation held the run for pytest-timeout's 300 s;
        # now the test fails at once, saying where the tasks wait.
        stopping = asyncio.ensure_future(service.stop())
        done, _ = await asyncio.wait({stopping}, timeout=STOP_S)
        if not done:
            hung.append(waiting_tasks())
        if not client.is_closed:
            with contextlib.suppress(Exception):
                await client.jetstream().delete_consumer(bus.EVENTS_STREAM, consumer)
            await client.drain()
    assert not hung, f"quota service did not stop within {STOP_S:g} s:\n" + "\n".join(hung)
