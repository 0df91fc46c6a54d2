"""Fixtures for the admission webhook tests: the app in-process, a private NATS for quota."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera.bus import connect, ensure_events_stream
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats


@pytest.fixture(scope="package")
def admission_nats() -> Iterator[EmbeddedNats]:
    """A broker of our own: the quota double must be the only responder on tessera.quota.*."""
    server = EmbeddedNats()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
async def admission_nc(admission_nats: EmbeddedNats) -> AsyncIterator[object]:
    client = await connect(NatsSettings(NATS_URL=admission_nats.url), name="admission-test")
    await ensure_events_stream(client.jetstream())
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def no_quota_settings() -> TesseraSettings:
    return TesseraSettings(quota_enabled=False)


@pytest.fixture
async def client(no_quota_settings: TesseraSettings) -> AsyncIterator[httpx.AsyncClient]:
    """The webhook app in-process (no quota service, no events): for the rules and bad input."""
    app = AdmissionApp(no_quota_settings, metrics=AdmissionMetrics())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://webhook") as http:
        http.app = app  # type: ignore[attr-defined]
        yield http
