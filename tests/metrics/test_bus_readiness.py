"""The metrics service says not-ready while the bus is not usable: NATS unreachable, or back but
its buckets/streams not yet checked/re-created by the BusKeeper (as the other services do)."""

from __future__ import annotations

import asyncio
import time

import httpx
from tessera.metrics.service import run

from tessera.bus import BusKeeper, connect, ensure_bus
from tessera.service import ServiceContext
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats, free_port


async def readyz(url: str) -> int:
    async with httpx.AsyncClient() as client:
        try:
            return (await client.get(f"{url}/readyz", timeout=2.0)).status_code
        except httpx.HTTPError:
            return 0


async def until(check, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_readyz_follows_the_bus(fresh_nats: EmbeddedNats) -> None:
    port = free_port()
    settings = TesseraSettings().model_copy(update={"listen": f"127.0.0.1:{port}"})
    nats_settings = NatsSettings(NATS_URL=fresh_nats.url)
    nc = await connect(nats_settings, name="metrics-readiness-test")
    js = nc.jetstream()
    buckets = await ensure_bus(js, settings)
    keeper = BusKeeper(js, settings)
    assert await keeper.check()
    ctx = ServiceContext("metrics", settings, nats_settings, nc, js, buckets, keeper=keeper)
    url = f"http://127.0.0.1:{port}"
    task = asyncio.create_task(run(ctx))
    try:
        await until(lambda: _is(url, 200))
        fresh_nats.stop()
        await until(lambda: _is(url, 503))  # NATS gone: not ready
        assert not await keeper.check()
        fresh_nats.start()

        async def reconnected() -> bool:
            return nc.is_connected

        await until(reconnected)
        # Connected again, but nobody has checked the store yet: still not ready.
        assert await readyz(url) == 503
        assert await keeper.check()
        await until(lambda: _is(url, 200))
    finally:
        ctx.stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()


async def _is(url: str, status: int) -> bool:
    return await readyz(url) == status
