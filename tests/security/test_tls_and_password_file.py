"""What the charts configure by default, against a real nats-server: TLS verified against a CA
(NATS_TLS_CA), a user with the password read from a mounted file (NATS_PASSWORD_FILE, the node
agent's host credential), and nothing for a client that does not trust the server's CA."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera import bus_permissions as bp
from tessera.bus import connect, ensure_bus
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.certs import write_certificates
from tessera_cli.nats_embedded import EmbeddedNats
from tessera_cli.stack_auth import StackAuth

NODE = "gpu-tls"


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, StackAuth,
                                                                          Path]]:
    certs = tmp_path_factory.mktemp("nats-certs")
    files = write_certificates(certs, ["localhost"], ["127.0.0.1"])
    auth = StackAuth.generate([NODE])
    config = auth.server_config() + (
        f'tls {{\n  cert_file: "{files.cert}"\n  key_file: "{files.key}"\n}}\n'
    )
    server = EmbeddedNats(auth_config=config).start()
    try:
        yield server, auth, files.ca_cert
    finally:
        server.cleanup()


async def test_node_agent_connects_over_tls_with_its_password_file(tls_nats, tmp_path) -> None:
    server, auth, ca = tls_nats
    user = bp.user_name(bp.NODE_AGENT, NODE)
    password_file = tmp_path / "password"
    password_file.write_text(auth.passwords[user] + "\n")
    password_file.chmod(0o400)
    settings = NatsSettings(NATS_URL=f"tls://127.0.0.1:{server.port}", NATS_USER=user,
                            NATS_PASSWORD_FILE=str(password_file), NATS_TLS_CA=str(ca))
    nc = await connect(settings, name="t-tls", initial_attempts=1)
    try:
        assert nc.is_connected
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        await buckets.nodes.put(NODE, b"{}")  # its own key, over TLS
    finally:
        await nc.close()


def _verify_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], ssl.SSLError)
            and "CERTIFICATE_VERIFY_FAILED" in str(r.exc_info[1])]  # fmt: skip


async def test_a_client_that_does_not_trust_the_ca_gets_nothing(
    tls_nats, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    server, auth, _ca = tls_nats
    other = write_certificates(tmp_path / "other", ["localhost"], ["127.0.0.1"])
    settings = NatsSettings(
        NATS_URL=f"tls://127.0.0.1:{server.port}", NATS_USER=bp.user_name(bp.ADMIN),
        NATS_PASSWORD=auth.passwords[bp.user_name(bp.ADMIN)], NATS_TLS_CA=str(other.ca_cert),
    )
    # The handshake fails (certificate verify failed): never connected. nats-py reports the
    # failure to its error callback, which logs it (and then waits to retry): once it is seen,
    # the client has been refused for the right reason and has not got in.
    attempt = asyncio.ensure_future(connect(settings, name="t-untrusted", initial_attempts=1))
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while not _verify_failures(caplog) and not attempt.done():
            assert asyncio.get_running_loop().time() < deadline, caplog.text[-2000:]
            await asyncio.sleep(0.02)
        assert not attempt.done() or attempt.exception() is not None, "connected untrusted"
        assert _verify_failures(caplog) or isinstance(attempt.exception(), ssl.SSLError)
    finally:
        attempt.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            nc = await attempt
            await nc.close()
