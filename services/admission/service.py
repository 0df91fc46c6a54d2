"""The admission service's main: wire settings, NATS, quota, events and the HTTP server."""

from __future__ import annotations

import logging
import socket

from tessera.service import ServiceContext
from tessera.settings import TesseraSettings

from .app import AdmissionApp
from .event_queue import EventQueue
from .metrics import AdmissionMetrics
from .quota_check import QuotaChecker
from .server import DEFAULT_LISTEN, TlsFiles, WebhookServer, parse_listen

log = logging.getLogger("tessera.admission")


def tls_files(settings: TesseraSettings) -> TlsFiles | None:
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("set both TESSERA_TLS_CERT and TESSERA_TLS_KEY, or neither")
    if settings.tls_cert and settings.tls_key:
        return TlsFiles(settings.tls_cert, settings.tls_key)
    return None


async def run_admission(ctx: ServiceContext) -> None:
    settings = ctx.settings
    metrics = AdmissionMetrics()
    events = EventQueue(ctx.js, source=f"admission/{socket.gethostname()}",
                        on_drop=metrics.events_dropped.inc)
    quota = QuotaChecker(ctx.nc, settings.request_timeout_s) if settings.quota_enabled else None
    app = AdmissionApp(settings, metrics=metrics, quota=quota, events=events,
                       is_ready=ctx.bus_ready)
    host, port = parse_listen(settings.listen or DEFAULT_LISTEN)
    tls = tls_files(settings)
    if tls is None:
        log.warning("TESSERA_TLS_CERT/TESSERA_TLS_KEY not set: serving plain HTTP. The Kubernetes "
                    "API server only calls webhooks over TLS; create files with `tessera certs`")
    # uvicorn's start/stop lines duplicate ours (and carry terminal colours); keep its warnings.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    server = WebhookServer(app, host, port, tls)
    events.start()
    await server.start()
    try:
        await ctx.stop.wait()
    finally:
        await server.stop()
        await events.stop(drain_timeout_s=1.0)
