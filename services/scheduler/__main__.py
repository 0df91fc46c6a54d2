"""`python -m tessera.scheduler`: kube-scheduler extender and the allocation ledger."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from typing import TYPE_CHECKING

import uvloop

from tessera.cluster.factory import cluster_from_settings
from tessera.service import ServiceContext, print_help, run_service
from tessera.settings import settings_help

from .config import SchedulerSettings
from .gc_policy import collect_between_calls

if TYPE_CHECKING:
    from .runtime import SchedulerService

NAME = "scheduler"
DESCRIPTION = "kube-scheduler extender and the allocation ledger"
DEFAULT_LISTEN = "0.0.0.0:8888"


def one_blas_thread() -> None:
    """Keep numpy's BLAS to the calling thread (unless configured otherwise): the index does
    small vector operations, never BLAS, and OpenBLAS otherwise starts a thread per core when
    numpy is imported, a few hundredths of a second of every start spent on nothing. Call it
    before numpy is imported."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


async def freeze_when_ready(service: SchedulerService, quiet_s: float = 60.0) -> None:
    """Once the index is built, move it out of the cyclic GC's way: a full collection over
    5,000 nodes' objects otherwise stalls a filter call for tens of milliseconds.

    While the buckets are first listed the cyclic GC is off: the listing allocates millions of
    objects (none of them cyclic garbage) and each full collection it triggered walked them all
    again, a large part of the time to ready. It is on again at ready (the index frozen first,
    without a full collection: that alone took seconds at 5,000 nodes, right after ready), or
    after `quiet_s` if the scheduler is not ready by then."""
    gc.disable()
    try:
        await service.wait_ready(timeout=quiet_s)
    except TimeoutError:
        gc.enable()
        await service.wait_ready(timeout=3600)
    gc.freeze()
    gc.enable()
    await collect_between_calls()  # then collections between calls, never inside (gc_policy)


async def serve(ctx: ServiceContext) -> None:
    from .runtime import SchedulerService  # imported with the cyclic GC off (see main)

    config = SchedulerSettings()
    if config.tls_client_ca and not (config.tls_cert and config.tls_key):
        raise SystemExit("TESSERA_TLS_CLIENT_CA needs TESSERA_TLS_CERT and TESSERA_TLS_KEY")
    cluster = cluster_from_settings(ctx.settings)
    service = SchedulerService(
        ctx.settings, config, ctx.nc, ctx.js, ctx.buckets, cluster, instance=config.instance,
        clock=ctx.clock, keeper=ctx.keeper,
    )  # fmt: skip
    await service.start()
    host, port = split_listen(ctx.settings.listen or DEFAULT_LISTEN)
    http = asyncio.create_task(service.serve_http(host, port))
    servers = [http]
    if config.probe_listen:
        probe_host, probe_port = split_listen(config.probe_listen)
        servers.append(asyncio.create_task(
            service.serve_http(probe_host, probe_port, probes_only=True)
        ))  # fmt: skip
    ready = asyncio.create_task(freeze_when_ready(service))
    ctx.log.info("scheduler serving", extra={"listen": f"{host}:{port}",
                                             "instance": service.instance})  # fmt: skip
    try:
        await ctx.stop.wait()
    finally:
        ready.cancel()
        service.stopping.set()
        for server in servers:
            await server
        await service.stop()


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print_help(f"tessera-{NAME}", DESCRIPTION, settings_help(SchedulerSettings))
        return
    # The cyclic GC is off from here until the index is built (`freeze_when_ready`): importing
    # the service and listing the buckets allocate millions of objects and no cyclic garbage,
    # and the collections they triggered walked them all again (a tenth of the imports alone).
    gc.disable()
    one_blas_thread()
    # uvloop roughly halves the event loop's share of each request (HTTP and NATS alike).
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    run_service(NAME, DESCRIPTION, serve)


if __name__ == "__main__":
    main()
