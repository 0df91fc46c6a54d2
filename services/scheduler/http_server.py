"""The extender's HTTP/1.1 server: `Extender.respond` behind httptools' parser, on asyncio.

uvicorn ran it before. Per call it built an ASGI scope, a request-response cycle, an ASGI task
and two writes (status and headers, then the body: two socket sends, and two wake-ups of the
caller), which together cost more CPU than the extender's own JSON. Here a request is parsed by
the same C parser (httptools), answered by `Extender.respond`, and its reply written with one
send. What a caller sees is unchanged: the routes, their JSON, 404/405 (with `Allow`), 413
before the body is read (the connection is closed after it, the body unread), keep-alive (idle
connections closed after `KEEP_ALIVE_S`, as uvicorn's default), pipelined requests answered in
order, `Expect: 100-continue`, HEAD without a body, 400 and a close for what does not parse.
TLS is uvicorn's own context (`uvicorn.config.create_ssl_context`, the same defaults), so the
handshake, mutual TLS included, is what it was. The ASGI face (`Extender.__call__`) stays for
tests and any ASGI server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

from .api import Extender, Reply

log = logging.getLogger("tessera.scheduler.http")
KEEP_ALIVE_S = 5.0
# A request line's target and a header block beyond these are refused (400 and a close): none of
# the extender's routes needs more, and a parser fed without end would hold memory for it.
MAX_URL_BYTES = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: 20\r\nconnection: close\r\n\r\nInvalid HTTP request")
_TOO_LARGE = object()  # a request body over the limit (not kept)


def tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """uvicorn's context for the same settings (mutual TLS when `client_ca` is set)."""
    # Imported here: uvicorn (and click through it) costs ~0.05 s of every start, TLS or not.
    from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context

    return create_ssl_context(
        certfile=cert, keyfile=key, password=None, ssl_version=SSL_PROTOCOL_VERSION,
        cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE, ca_certs=client_ca,
        ciphers=None,
    )  # fmt: skip


def encode_reply(reply: Reply, head_only: bool, keep_alive: bool) -> bytes:
    parts = [_STATUS.get(reply.status) or f"HTTP/1.1 {reply.status} \r\n".encode(),
             b"content-length: %d\r\ncontent-type: " % len(reply.body), reply.content_type]
    for name, value in reply.headers:
        parts += [b"\r\n", name, b": ", value]
    parts.append(b"\r\n\r\n" if keep_alive else b"\r\nconnection: close\r\n\r\n")
    if not head_only:
        parts.append(reply.body)
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as they arrive, answered one at a time in order."""

    def __init__(self, server: ExtenderServer) -> None:
        self.server = server
        self.app = server.app
        self.limit = server.app.max_body_bytes
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[str, str, Any, bool]] = deque()
        self.worker: asyncio.Task[None] | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self.active_at = 0.0  # the last request data or reply: idle is counted from there
        self.writable: asyncio.Future[None] | None = None
        self.closing = False
        self._url = b""
        self._header_bytes = 0
        self._length = -1
        self._chunks: list[bytes] = []
        self._size = 0
        self._continue = self._answered = False
        self.paused = False

    # --- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self._disarm_idle()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def data_received(self, data: bytes) -> None:
        self.active_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse()
        except httptools.HttpParserError:
            self._refuse()


    # --- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._length, self._chunks, self._size = b"", -1, [], 0
        self._header_bytes = 0
        self._continue = self._answered = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            raise ValueError("request target too long")  # httptools: HttpParserCallbackError

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise ValueError("header block too large")  # httptools: HttpParserCallbackError
        name = name.lower()
        if name == b"content-length" and value.strip().isdigit():
            self._length = int(value)
        elif name == b"expect" and value.strip().lower() == b"100-continue":
            self._continue = True

    def on_headers_complete(self) -> None:
        if self._length > self.limit:
            # Answered at once, before the body comes (which is then read and dropped).
            self._answered = True
            self._enqueue(_TOO_LARGE)
        elif self._continue and not self.closing:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._size <= self.limit:
            self._size += len(body)
            if self._size <= self.limit:
                self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._answered:
            return
        chunks = self._chunks
        self._enqueue(_TOO_LARGE if self._size > self.limit else
                      chunks[0] if len(chunks) == 1 else b"".join(chunks))  # fmt: skip

    def _enqueue(self, body: Any) -> None:
        method = self.parser.get_method().decode("ascii", "replace")
        path = unquote(self._url.split(b"?", 1)[0].decode("latin-1"))
        self.queue.append((method, path, body, self.parser.should_keep_alive()))
        if len(self.queue) > 16 and not self.paused:
            self.paused = True  # a client pipelining without reading: wait for it
            self.transport.pause_reading()
        if self.worker is None:
            self.worker = self.loop.create_task(self._serve())

    # --- answering ----------------------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            while self.queue and not self.closing:
                method, path, body, keep_alive = self.queue.popleft()
                handler = self.app.route(method, path)
                try:
                    if isinstance(handler, Reply):
                        reply = handler
                    elif body is _TOO_LARGE:
                        reply = self.app.too_large()
                    else:
                        reply = await handler(body)
                except Exception:
                    log.exception("request failed", extra={"path": path})
                    reply = Reply(500, b"Internal Server Error", b"text/plain; charset=utf-8")
                if self.closing:
                    return
                keep_alive = keep_alive and not self.server.stopping
                self.transport.write(encode_reply(reply, method == "HEAD", keep_alive))
                if not keep_alive:
                    self.closing = True
                    self.transport.close()
                    return
                if self.writable is not None:
                    await self.writable
                if self.paused and len(self.queue) <= 16:
                    self.paused = False
                    self.transport.resume_reading()
        finally:
            self.worker = None
            self.active_at = self.loop.time()

    def _refuse(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.write(_BAD_REQUEST)
            self.transport.close()

    def _arm_idle(self) -> None:
        """One timer per connection, not one per request: when it fires early (the connection
        was active since), it is set again for what is left of KEEP_ALIVE_S."""
        self.active_at = self.loop.time()
        self.idle = self.loop.call_later(KEEP_ALIVE_S, self._check_idle)

    def _disarm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _check_idle(self) -> None:
        self.idle = None
        if self.closing:
            return
        if self.worker is not None or self.queue:  # answering: idle counts from the reply
            self.idle = self.loop.call_later(KEEP_ALIVE_S, self._check_idle)
            return
        left = self.active_at + KEEP_ALIVE_S - self.loop.time()
        if left > 0:
            self.idle = self.loop.call_later(left, self._check_idle)
            return
        self._close_idle()

    def _close_idle(self) -> None:
        if self.worker is None and not self.queue and not self.closing:
            self.closing = True
            self.transport.close()

    def close_if_idle(self) -> bool:
        """For shutdown: close now if nothing is being answered; True when closed."""
        if self.worker is None and not self.queue:
            self._close_idle()
            return True
        return False


class ExtenderServer:
    """Listens and serves `app` until `serve` is cancelled or `stop` is called."""

    def __init__(self, app: Extender, tls: ssl.SSLContext | None = None) -> None:
        self.app = app
        self.tls = tls
        self.connections: set[_Connection] = set()
        self.stopping = False

    async def serve(self, host: str, port: int, stop: asyncio.Event, grace_s: float = 2.0) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), host, port, ssl=self.tls, reuse_address=True, backlog=2048,
        )  # fmt: skip
        try:
            await stop.wait()
        finally:
            self.stopping = True
            server.close()
            deadline = loop.time() + grace_s
            while loop.time() < deadline:
                busy = [c for c in list(self.connections) if not c.close_if_idle()]
                if not busy:
                    break
                await asyncio.sleep(0.05)
            for connection in list(self.connections):
                with contextlib.suppress(Exception):
                    connection.transport.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
