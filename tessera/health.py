"""`/healthz` and `/readyz` for services without an HTTP face of their own (quota, node agent),
so Kubernetes probes and operators' tools can ask them the usual way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

_MAX_REQUEST_LINE = 4096


_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def _response(status: str, body: str, content_type: str = "text/plain; charset=utf-8") -> bytes:
    payload = body.encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


def answer(
    request_line: bytes,
    ready: Callable[[], bool],
    metrics: Callable[[], bytes | None] | None = None,
) -> bytes:
    """The response to one request line (pure, so it is easy to test). `metrics`, when it
    gives bytes, is served at /metrics (Prometheus text)."""
    parts = request_line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", "bad request\n")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", "only GET\n")
    if target == "/healthz":
        return _response("200 OK", "ok\n")
    if target == "/readyz":
        if ready():
            return _response("200 OK", "ready\n")
        return _response(
            "503 Service Unavailable", "not ready: no connection to NATS or its buckets\n"
        )
    if target == "/metrics" and metrics is not None:
        body = metrics()
        if body is not None:
            return _response("200 OK", body.decode(), _PROMETHEUS)
    return _response("404 Not Found", "try /healthz or /readyz\n")


async def serve_health(
    listen: str,
    ready: Callable[[], bool],
    stop: asyncio.Event,
    metrics: Callable[[], bytes | None] | None = None,
) -> None:
    """Serve the two probes (and /metrics when given) on `listen` until `stop` is set."""
    host, _, port = listen.rpartition(":")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5.0)
            if len(line) > _MAX_REQUEST_LINE:
                line = b""
            writer.write(answer(line.strip(), ready, metrics))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host or "0.0.0.0", int(port))
    async with server:
        await stop.wait()
