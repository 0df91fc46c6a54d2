"""The metrics service: the feeds keep a view current, the web app serves it.

Built directly by tests (with a NATS connection from the fixtures) and by `main` below through
`run_service`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import uvicorn
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from tessera.bus import Buckets
from tessera.embedded_http import EmbeddedUvicorn
from tessera.service import ServiceContext
from tessera.settings import TesseraSettings
from tessera.validation import Bounds

from .feeds import Feeds
from .view import ClusterView
from .web import build_app

DEFAULT_LISTEN = "0.0.0.0:9394"
log = logging.getLogger("tessera.metrics")


def parse_listen(listen: str | None) -> tuple[str, int]:
    host, _, port = (listen or DEFAULT_LISTEN).rpartition(":")
    return (host.strip("[]") or "0.0.0.0"), int(port)


class MetricsService:
    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        buckets: Buckets,
        settings: TesseraSettings,
        *,
        listen: str | None = None,
        clock: Callable[[], float] = time.time,
        bus_ready: Callable[[], bool] | None = None,
    ) -> None:
        self.view = ClusterView(
            bounds=Bounds.of(settings), node_stale_s=2 * settings.node_ttl_s
        )
        self.settings = settings
        self.feeds = Feeds(nc, js, buckets, self.view, clock)
        self.app = build_app(self.view, settings, clock, bus_ready)
        self.host, self.port = parse_listen(listen or settings.listen)
        self._server: EmbeddedUvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        await self.feeds.start()
        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_config=None, access_log=False,
            lifespan="off",
        )
        self._server = EmbeddedUvicorn(config)
        self._serve_task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serve_task.done():
                await self._serve_task  # raises the bind error
                raise RuntimeError(f"metrics http server did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        log.info("serving", extra={"listen": f"{self.host}:{self.port}"})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serve_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serve_task, timeout=3.0)
        await self.feeds.stop()


async def run(ctx: ServiceContext) -> None:
    service = MetricsService(ctx.nc, ctx.js, ctx.buckets, ctx.settings, bus_ready=ctx.bus_ready)
    await service.start()
    try:
        synced = asyncio.create_task(service.feeds.wait_synced(timeout=60.0))
        stopping = asyncio.create_task(ctx.stop.wait())
        await asyncio.wait({synced, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if synced.done():
            if synced.result():
                log.info("bus replayed", extra={"events": service.view.events_applied})
            else:
                log.warning("bus replay not finished after 60 s; serving what is known so far")
        synced.cancel()
        await stopping
    finally:
        await service.stop()
