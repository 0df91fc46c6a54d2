"""Shared fixtures: a real nats-server with JetStream, started once per test session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from tessera.bus import Buckets, connect, ensure_bus
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats
from tessera_cli.stack_auth import StackAuth

# The GPU nodes the authenticated server has identities for (a dotted name included).
AUTH_NODES = ("node-a", "node-b", "gpu.node-c")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def fresh_nats() -> Iterator[EmbeddedNats]:
    """A private server for tests that stop, kill or restart the broker."""
    server = EmbeddedNats()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


class AuthNats:
    """A nats-server enforcing the generated permissions, and every identity's password."""

    def __init__(self, server: EmbeddedNats, auth: StackAuth) -> None:
        self.server = server
        self.auth = auth
        self.url = server.url
        self.nodes = AUTH_NODES

    def settings(self, role: str, node: str | None = None) -> NatsSettings:
        return self.auth.settings(self.url, role, node)


@pytest.fixture(scope="session")
def auth_nats() -> Iterator[AuthNats]:
    """A private server with authorization on: one user per service and per node agent of
    AUTH_NODES, anonymous clients refused (tessera.bus_permissions)."""
    auth = StackAuth.generate(AUTH_NODES)
    server = EmbeddedNats(auth_config=auth.server_config())
    server.start()
    try:
        yield AuthNats(server, auth)
    finally:
        server.cleanup()


@pytest.fixture
def settings() -> TesseraSettings:
    return TesseraSettings()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[object]:
    client = await connect(NatsSettings(NATS_URL=nats_url), name="tessera-test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def buckets(nc: object, settings: TesseraSettings) -> Buckets:
    """The bus on the session server. Tests must use unique keys (uuid) to stay independent."""
    return await ensure_bus(nc.jetstream(), settings)  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    # Services read settings from the environment; keep a developer's shell out of the tests.
    for key in list(os.environ):
        if key.startswith("TESSERA_") or key.startswith("NATS_"):
            del os.environ[key]
