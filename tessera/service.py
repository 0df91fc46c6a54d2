"""How every service starts: settings from env, JSON logs, NATS, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from tessera.bus import Buckets, BusKeeper, connect, ensure_bus, while_bus_away
from tessera.clock import ServerClock
from tessera.health import serve_health
from tessera.logging import configure_logging
from tessera.settings import NatsSettings, TesseraSettings, settings_help


@dataclass
class ServiceContext:
    """What a service's main receives: everything it may touch, built once."""

    name: str
    settings: TesseraSettings
    nats_settings: NatsSettings
    nc: NatsClient
    js: JetStreamContext
    buckets: Buckets
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tessera"))
    # Re-creates lost buckets/streams and says whether the bus is usable (readiness).
    keeper: BusKeeper | None = None
    # now() on the NATS server's clock: for every lease judged between machines.
    clock: ServerClock = field(default_factory=ServerClock)
    # Set by a service's main to serve /metrics beside the probes (Prometheus text).
    metrics: Callable[[], bytes] | None = None

    def bus_ready(self) -> bool:
        return self.nc.is_connected and (self.keeper is None or self.keeper.ready)


ServiceMain = Callable[[ServiceContext], Awaitable[None]]


def print_help(
    name: str, description: str, extra: list[tuple[str, str, str]] | None = None
) -> None:
    # rich only for --help: importing it is a tenth of a second of every service's start.
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{name}[/bold]: {description}\n")
    console.print("Configured only by environment variables (or a file named by TESSERA_ENV_FILE):")
    table = Table("variable", "default", "meaning")
    for row in settings_help(NatsSettings) + settings_help(TesseraSettings) + (extra or []):
        table.add_row(*row)
    console.print(table)


async def serve(
    name: str,
    main: ServiceMain,
    settings: TesseraSettings | None = None,
    health_probes: bool = False,
) -> None:
    """Connect to NATS, ensure the bus exists, run `main` until SIGTERM/SIGINT, then clean up.

    With `health_probes` and TESSERA_LISTEN set, /healthz and /readyz (= connected to NATS) are
    served there, for services that have no HTTP face of their own."""
    settings = settings or TesseraSettings()
    nats_settings = NatsSettings()
    log = logging.getLogger(f"tessera.{name}")
    nc = await connect(nats_settings, name=f"tessera-{name}")
    js = nc.jetstream()
    buckets = await while_bus_away("ensure the bus", lambda: ensure_bus(js, settings))
    keeper = BusKeeper(js, settings)
    await keeper.check()  # remembers the streams this service starts on, so a loss shows
    skew = settings.clock_skew_s
    clock = ServerClock(local=(lambda: time.time() + skew) if skew else time.time)
    ctx = ServiceContext(name, settings, nats_settings, nc, js, buckets, log=log, keeper=keeper,
                         clock=clock)  # fmt: skip
    upkeep = [
        asyncio.create_task(keeper.run(ctx.stop, settings.bus_check_interval_s)),
        asyncio.create_task(ctx.clock.run(js, f"{name}-{socket.gethostname()}-{os.getpid()}",
                                          ctx.stop, settings.clock_sync_interval_s)),
    ]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stop.set)
    log.info("started", extra={"nats": nats_settings.url})
    task = asyncio.create_task(main(ctx))
    probes = None
    if health_probes and settings.listen:
        probes = asyncio.create_task(
            serve_health(settings.listen, ctx.bus_ready, ctx.stop,
                         lambda: ctx.metrics() if ctx.metrics else None)
        )
        log.info("health probes", extra={"listen": settings.listen})
    stopper = asyncio.create_task(ctx.stop.wait())
    _done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    ctx.stop.set()
    try:
        # The service's main watches ctx.stop and returns; give it a few seconds.
        await asyncio.wait_for(task, timeout=5.0)
    except TimeoutError:
        task.cancel()
        log.warning("service main did not stop in 5 s; cancelled")
    finally:
        stopper.cancel()
        for upkeep_task in upkeep:
            upkeep_task.cancel()
        if probes is not None:
            probes.cancel()
        await nc.drain() if nc.is_connected else await nc.close()
    if task.done() and not task.cancelled() and task.exception():
        raise task.exception()  # type: ignore[misc]
    log.info("stopped")


def run_service(
    name: str, description: str, main: ServiceMain, health_probes: bool = False
) -> None:
    """Entry point shared by every `python -m tessera.<service>`."""
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print_help(f"tessera-{name}", description)
        return
    settings = TesseraSettings()
    configure_logging(name, settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(name, main, settings, health_probes))


async def idle_until_stopped(ctx: ServiceContext) -> None:
    """The main of a service that has nothing to do yet: wait for the stop signal."""
    await ctx.stop.wait()
