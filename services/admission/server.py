"""Serve the webhook with uvicorn (httptools), over TLS whose files are reloaded when they change.

Certificates rotate (cert-manager, `tessera certs`) while the webhook runs: a watcher loads the
files into a fresh SSLContext and, once that succeeded, hands it to every new connection (from
the listening context's SNI callback, which OpenSSL calls with or without SNI). Connections
already open keep theirs, nothing is dropped, and a half-written pair (cert and key not matching
yet) never replaces a working one: it is retried at the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

import uvicorn

from tessera.embedded_http import EmbeddedUvicorn

log = logging.getLogger("tessera.admission")

DEFAULT_LISTEN = "0.0.0.0:9443"


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when either file is replaced or rewritten."""
        stats = (os.stat(self.cert), os.stat(self.key))
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"TESSERA_LISTEN must be host:port, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def server_tls_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(files.cert, files.key)
    return context


class WebhookServer:
    """Start, learn the bound port, stop. `reload_interval_s` paces the certificate watcher."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        tls: TlsFiles | None,
        *,
        reload_interval_s: float = 5.0,
    ) -> None:
        self.tls = tls
        self.reload_interval_s = reload_interval_s
        self.context = server_tls_context(tls) if tls else None
        self.current_context = self.context
        if self.context is not None:
            self.context.sni_callback = self._select_context
        self._signature = tls.signature() if tls else None
        context = self.context
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http="httptools",
            ws="none",
            loop="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            date_header=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=3,
            limit_concurrency=1000,
            ssl_context_factory=(lambda _config, _default: context) if context else None,
        )
        self.server = EmbeddedUvicorn(self.config)
        self._serving: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self.reloads = 0

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._serving = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._serving.done():
                self._serving.result()  # raises why it could not start
                raise RuntimeError("webhook server stopped during start-up")
            await asyncio.sleep(0.01)
        if self.tls:
            self._watching = asyncio.create_task(self._watch_certificates())
        log.info("webhook listening", extra={"port": self.port, "tls": self.tls is not None})

    async def stop(self) -> None:
        if self._watching:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
        self.server.should_exit = True
        if self._serving:
            await self._serving

    def _select_context(
        self, connection: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext
    ) -> None:
        if self.current_context is not self.context:
            connection.context = self.current_context  # type: ignore[assignment]

    def reload_if_changed(self) -> bool:
        """Serve the files from now on if they changed and form a valid pair; True if so."""
        assert self.tls is not None
        try:
            signature = self.tls.signature()
            if signature == self._signature:
                return False
            fresh = server_tls_context(self.tls)
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS files unreadable or mismatched; keeping the current certificate",
                        extra={"err": str(exc)})
            return False
        self.current_context = fresh
        self._signature = signature
        self.reloads += 1
        log.info("TLS certificate reloaded", extra={"cert": self.tls.cert})
        return True

    async def _watch_certificates(self) -> None:
        while True:
            await asyncio.sleep(self.reload_interval_s)
            self.reload_if_changed()
