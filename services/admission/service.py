"""The admission service's main: wire settings, NATS, quota, events and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from tessera.cluster.factory import cluster_from_settings
from tessera.cluster.port import ClusterError
from tessera.service import ServiceContext
from tessera.settings import TesseraSettings
from tessera.signing import process_signer

from .app import AdmissionApp
from .certificates import CertificateProvisioner, CertProvisionSettings
from .dra_templates import DraTemplates
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


async def provision_certificate(tls: TlsFiles | None, stop: asyncio.Event
                                ) -> CertificateProvisioner | None:
    """With TESSERA_WEBHOOK_CERT_SECRET: the webhook's own certificate in place before it serves
    (retried while the API server cannot be reached), and the provisioner that renews it."""
    cert_settings = CertProvisionSettings()
    if not cert_settings.enabled:
        return None
    if tls is None:
        raise ValueError("TESSERA_WEBHOOK_CERT_SECRET needs TESSERA_TLS_CERT and TESSERA_TLS_KEY "
                         "(where to write the certificate)")
    from tessera.cluster.kubernetes_api import KubernetesCluster  # heavy import, only when used

    provisioner = CertificateProvisioner(KubernetesCluster.from_environment(), cert_settings,
                                         tls.cert, tls.key)
    delay = 1.0
    while not stop.is_set():
        try:
            await provisioner.ensure()
            return provisioner
        except (ClusterError, OSError) as exc:
            log.warning("cannot provision the webhook certificate yet; retrying",
                        extra={"err": str(exc), "delay": delay})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, 30.0)
    return None


async def run_admission(ctx: ServiceContext) -> None:
    settings = ctx.settings
    metrics = AdmissionMetrics()
    events = EventQueue(ctx.js, source=f"admission/{socket.gethostname()}",
                        on_drop=metrics.events_dropped.inc)
    quota = None
    if settings.quota_enabled:
        signer = process_signer(settings.command_key_file, ctx.clock)
        quota = QuotaChecker(ctx.nc, settings.request_timeout_s, signer)
    app = AdmissionApp(settings, metrics=metrics, quota=quota, events=events,
                       is_ready=ctx.bus_ready, dra=DraTemplates(cluster_from_settings(settings),
                                                                settings))  # fmt: skip
    host, port = parse_listen(settings.listen or DEFAULT_LISTEN)
    tls = tls_files(settings)
    provisioner = await provision_certificate(tls, ctx.stop)
    if ctx.stop.is_set():
        return  # stopped before it had a certificate to serve
    if tls is None:
        log.warning("TESSERA_TLS_CERT/TESSERA_TLS_KEY not set: serving plain HTTP. The Kubernetes "
                    "API server only calls webhooks over TLS; create files with `tessera certs`")
    # uvicorn's start/stop lines duplicate ours (and carry terminal colours); keep its warnings.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    server = WebhookServer(app, host, port, tls)
    events.start()
    await server.start()
    renewing = asyncio.create_task(provisioner.run(ctx.stop)) if provisioner else None
    try:
        await ctx.stop.wait()
    finally:
        if renewing:
            await renewing
        await server.stop()
        await events.stop(drain_timeout_s=1.0)
