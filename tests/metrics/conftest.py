"""A private NATS server per test for the metrics service."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from metrics_testkit import Bus

from tessera.bus import connect, ensure_bus
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats


@pytest.fixture
async def bus(fresh_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    """A private NATS server, so counters over the whole event stream are this test's alone."""
    settings = TesseraSettings()
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="metrics-test")
    try:
        buckets = await ensure_bus(nc.jetstream(), settings)
        yield Bus(fresh_nats, nc, buckets, settings)
    finally:
        await nc.close()

