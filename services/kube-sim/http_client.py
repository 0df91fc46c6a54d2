"""kube-sim's outgoing calls (the admission webhook's reviews, the scheduler extender's filter and
bind): JSON POSTs over kept-alive HTTP/1.1 connections, TLS as configured.

kube-apiserver and kube-scheduler make these calls with Go's HTTP client. httpx did it here at
a cost that dominated kube-sim's CPU under a burst of pods (its pool polled every idle
connection's socket on each request and went through several layers per call): this keeps
what those calls need and nothing more. A connection is reused only while the peer keeps it
(`connection: close`, an EOF seen, or idle past `IDLE_S` retire it: servers close idle
connections after a few seconds, uvicorn after 5); a request is never sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from tessera.quantity import is_plain_digits

IDLE_S = 4.0  # an idle connection older than this is closed rather than reused
MAX_IDLE = 32  # idle connections kept per client
MAX_HEAD = 64 * 1024


class HttpError(Exception):
    """The call did not complete (connection, TLS, timeout, malformed reply)."""


class Reply:
    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def usable(self) -> bool:
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < IDLE_S)  # fmt: skip

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class JsonPoster:
    """POST JSON to `base_url` + path; `tls` for https:// (None: the default verification)."""

    def __init__(self, base_url: str, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2]
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def post(self, path: str, payload: Any) -> Reply:
        data = json.dumps(payload, separators=(",", ":")).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nhost: {self.host_header}\r\n"
                "content-type: application/json\r\naccept: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n").encode()  # fmt: skip
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self._connection()
                conn.writer.write(head + data)
                status, body, keep = await _read_reply(conn.reader)
        except TimeoutError as exc:
            if conn is not None:
                conn.close()
            raise HttpError(f"no reply within {self.timeout_s:g} s") from exc
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError) as exc:
            if conn is not None:
                conn.close()
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled mid-call: the connection's state is unknown
            if conn is not None:
                conn.close()
            raise
        if keep and len(self._idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return Reply(status, body)

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=self.tls, limit=MAX_HEAD,
            server_hostname=self.host if self.tls is not None else None,
        )  # fmt: skip
        return _Connection(reader, writer)


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection may be reused) of one HTTP/1.x response."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise EOFError("the connection closed before a reply") from exc
    lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
    # three ASCII digits (str.isdigit takes '²', which int() refuses, and '١٢٣', which it reads)
    if not version.startswith("HTTP/1.") or len(code) != 3 or not is_plain_digits(code):
        raise ValueError(f"not an HTTP/1 reply: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return int(code), await _read_chunked(reader), keep
    if "content-length" in headers:
        if not is_plain_digits(headers["content-length"]):
            raise ValueError(f"bad Content-Length {headers['content-length'][:40]!r}")
        length = int(headers["content-length"])
        try:
            return int(code), await reader.readexactly(length), keep
        except asyncio.IncompleteReadError as exc:
            raise EOFError("the connection closed inside the reply") from exc
    return int(code), await reader.read(), False  # delimited by the close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    try:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    except asyncio.IncompleteReadError as exc:
        raise EOFError("the connection closed inside the reply") from exc
