"""The CLI's commands carry the admin's signature (tessera.signing): quota set, limits set,
node-config set. The key is TESSERA_COMMAND_KEY_FILE (from the environment, TESSERA_ENV_FILE, or
the local stack's admin env file); the expiry is stamped on the NATS server's clock."""

from __future__ import annotations

import contextlib
import time

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tessera.clock import ServerClock
from tessera.settings import NatsSettings, TesseraSettings
from tessera.signing import Signer, signer_from_files


def _key_file(admin_env: str | None) -> str | None:
    own = TesseraSettings().command_key_file
    if own or not admin_env:
        return own
    return TesseraSettings(_env_file=admin_env).command_key_file  # type: ignore[call-arg]


async def cli_signer(nc: NatsClient, user: str | None, admin_env: str | None = None) -> Signer:
    clock = ServerClock()
    with contextlib.suppress(Exception):  # an identity without the clock's rights: local time
        await clock.measure(nc.jetstream(), f"cli-{user or 'anonymous'}-{time.time_ns()}")
    return signer_from_files(user or NatsSettings().user, _key_file(admin_env), clock)


async def signed_request(
    nc: NatsClient, subject: str, payload: bytes, timeout: float, *, user: str | None = None,
    admin_env: str | None = None,
) -> Msg:
    signer = await cli_signer(nc, user, admin_env)
    return await nc.request(subject, payload, timeout=timeout,
                            headers=signer.headers(subject, payload))  # fmt: skip
