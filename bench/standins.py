"""The benchmarks' stand-ins for kube-scheduler's HTTP client and the node agents' Allocate,
doing on the wire what the real ones do, with as little CPU as Python allows.

In a cluster both run on other machines (kube-scheduler, in Go, on the control plane; a node
agent on each node); here they share the 2 cores with the scheduler and nats-server they load,
so every millisecond they spend per pod is taken from what is measured. What they send and
receive is unchanged:

- `LeanClient`: HTTP/1.1 keep-alive JSON POSTs (`POST <path>`, `Content-Length`, the body; the
  reply's status line, headers and body read whole, the JSON parsed), one request in flight per
  connection, a pool of connections. An asyncio Protocol instead of asyncio streams.
- `LeanAgent`: a NATS client speaking the protocol itself (CONNECT, SUB, PUB/HPUB, MSG/HMSG,
  PING/PONG) instead of nats-py's request machinery. On each `alloc.<node>.bound` event it does
  what the node agent's Allocate does through `bus.cas_update`, with the very requests nats-py's
  `KeyValue.get` and `KeyValue.update` send: the stream-message get
  (`$JS.API.STREAM.MSG.GET.KV_<bucket>` with `{"last_by_subj": ...}`), then the edited entry
  published to `$KV.<bucket>.<node>` with `Nats-Expected-Last-Subject-Sequence`, awaiting the
  stream's ack; a wrong-last-sequence refusal reads and writes again. Each node's Allocate runs
  on its own (every node has its own agent), driven by callbacks rather than a task per pod.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import msgpack

# --- kube-scheduler's HTTP client ---------------------------------------------------------------


class _HttpConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Any = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Any] | None = None
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("the scheduler closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in bytes(self.buffer[:end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(body)


class LeanClient:
    """Keep-alive HTTP/1.1 JSON POSTs to the scheduler at 127.0.0.1:`port` (see the module)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[_HttpConnection] = []
        self.opened: list[_HttpConnection] = []

    async def post(self, path: str, body: bytes) -> Any:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                break
        else:
            loop = asyncio.get_running_loop()
            _transport, conn = await loop.create_connection(_HttpConnection, "127.0.0.1",
                                                            self.port)  # fmt: skip
            self.opened.append(conn)
        head = (b"POST %s HTTP/1.1\r\nHost: scheduler\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)))  # fmt: skip
        conn.waiter = asyncio.get_running_loop().create_future()
        conn.transport.writelines((head, body))
        payload = await conn.waiter
        conn.waiter = None
        self.idle.append(conn)
        return json.loads(payload)

    async def close(self) -> None:
        for conn in self.opened:
            if conn.transport is not None:
                conn.transport.close()


# --- the node agents' Allocate ------------------------------------------------------------------

_CRLF = b"\r\n"
_WRONG_LAST_SEQUENCE = (10071, 10164)  # as nats-py's KeyValue.update reads them


class _NatsConnection(asyncio.Protocol):
    """The NATS client protocol, as much of it as the stand-in needs."""

    def __init__(self, on_msg: Callable[[bytes, bytes, bytes, bytes], None]) -> None:
        self.on_msg = on_msg  # (subject, reply, headers, payload)
        self.transport: Any = None
        self.buffer = bytearray()
        self.out: list[bytes] = []
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def send(self, *parts: bytes) -> None:
        """Queued; written once per turn of the loop (as nats-py's flusher does)."""
        if not self.out:
            asyncio.get_running_loop().call_soon(self._flush)
        self.out.extend(parts)

    def _flush(self) -> None:
        out, self.out = self.out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        at = 0
        while True:
            eol = buf.find(_CRLF, at)
            if eol < 0:
                break
            line = bytes(buf[at:eol])
            if line.startswith((b"MSG ", b"HMSG ")):
                fields = line.split()
                total = int(fields[-1])
                if len(buf) < eol + 2 + total + 2:
                    break
                body = bytes(buf[eol + 2 : eol + 2 + total])
                at = eol + 2 + total + 2
                hlen = int(fields[-2]) if fields[0] == b"HMSG" else 0
                reply = fields[3] if len(fields) == (6 if hlen else 5) else b""
                self.on_msg(fields[1], reply, body[:hlen], body[hlen:])
                continue
            at = eol + 2
            if line.startswith(b"PING"):
                self.send(b"PONG\r\n")
            elif line.startswith(b"PONG") and not self.pong.done():
                self.pong.set_result(None)
            elif line.startswith(b"INFO") and not self.ready.done():
                self.ready.set_result(None)
            elif line.startswith(b"-ERR"):
                raise RuntimeError(f"nats-server: {line.decode(errors='replace')}")
        del buf[:at]


class LeanAgent:
    """Every node agent's Allocate for the bench (see the module): on `<prefix>.alloc.<node>.
    bound`, `edit(uid, entry bytes)` (raising `skip` when there is nothing to do) is written back
    to the node's ledger entry by CAS."""

    def __init__(self, url: str, bucket: str, events: str,
                 edit: Callable[[str, bytes], bytes], skip: type[Exception]) -> None:  # fmt: skip
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        self.bucket, self.events, self.edit, self.skip = bucket, events, edit, skip
        self.inbox = f"_INBOX.{base64.b32encode(os.urandom(10)).decode()}."
        self.tokens = itertools.count(1)
        self.pending: dict[bytes, tuple[str, str, str, int]] = {}  # token -> (what, node, uid, n)
        self.conn: _NatsConnection | None = None
        self.allocated = 0
        self.gave_up = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        _transport, self.conn = await loop.create_connection(
            lambda: _NatsConnection(self._on_msg), self.host, self.port
        )
        await self.conn.ready
        connect = {"verbose": False, "pedantic": False, "lang": "python3", "version": "bench",
                   "protocol": 1, "headers": True, "no_responders": True,
                   "name": "bench-agents"}  # fmt: skip
        self.conn.send(b"CONNECT %s\r\n" % json.dumps(connect).encode(),
                       b"SUB %s 1\r\n" % self.events.encode(),
                       b"SUB %s* 2\r\n" % self.inbox.encode(), b"PING\r\n")  # fmt: skip
        await self.conn.pong  # the server has the subscriptions

    def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()

    # --- the CAS, one callback per answer ---------------------------------------------------------
    def _on_msg(self, subject: bytes, reply: bytes, headers: bytes, payload: bytes) -> None:
        if subject.startswith(b"_INBOX."):
            job = self.pending.pop(subject.rsplit(b".", 1)[1], None)
            if job is not None:
                (self._on_entry if job[0] == "get" else self._on_ack)(job, headers, payload)
            return
        # a bound event: its node and pod (the payload is the event, msgpack)
        data = msgpack.unpackb(payload)["data"]
        self._get(data["node"], data["pod_uid"], 0)

    def _request(self, job: tuple[str, str, str, int], subject: str, payload: bytes,
                 headers: bytes = b"") -> None:  # fmt: skip
        assert self.conn is not None
        token = str(next(self.tokens)).encode()
        self.pending[token] = job
        reply = self.inbox.encode() + token
        if headers:
            self.conn.send(b"HPUB %s %s %d %d\r\n" % (subject.encode(), reply, len(headers),
                                                      len(headers) + len(payload)),
                           headers, payload, _CRLF)  # fmt: skip
        else:
            self.conn.send(b"PUB %s %s %d\r\n" % (subject.encode(), reply, len(payload)),
                           payload, _CRLF)  # fmt: skip

    def _get(self, node: str, uid: str, attempt: int) -> None:
        if attempt >= 20:
            self.gave_up += 1
            return
        request = json.dumps({"last_by_subj": f"$KV.{self.bucket}.{node}"}).encode()
        self._request(("get", node, uid, attempt), f"$JS.API.STREAM.MSG.GET.KV_{self.bucket}",
                      request)  # fmt: skip

    def _on_entry(self, job: tuple[str, str, str, int], headers: bytes, payload: bytes) -> None:
        _what, node, uid, attempt = job
        answer = json.loads(payload)
        message = answer.get("message")
        if message is None:  # no such key (or an error): nothing to allocate
            self.gave_up += 1
            return
        try:
            value = self.edit(uid, base64.b64decode(message.get("data", "")))
        except self.skip:
            return
        header = b"NATS/1.0\r\nNats-Expected-Last-Subject-Sequence: %d\r\n\r\n" % message["seq"]
        self._request(("update", node, uid, attempt), f"$KV.{self.bucket}.{node}", value, header)

    def _on_ack(self, job: tuple[str, str, str, int], headers: bytes, payload: bytes) -> None:
        _what, node, uid, attempt = job
        ack = json.loads(payload) if payload else {"error": {"err_code": 503}}
        error = ack.get("error")
        if error is None:
            self.allocated += 1
        elif error.get("err_code") in _WRONG_LAST_SEQUENCE:
            self._get(node, uid, attempt + 1)  # the scheduler wrote meanwhile: read again
        else:
            self.gave_up += 1
