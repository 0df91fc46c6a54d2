"""JetStream publishes that wait for their ack, with little work per call.

nats-py's `js.publish` (under every KV update and every event) is a request: a fresh NUID and
`os.urandom` token, an `asyncio.wait_for`, the ack parsed into a `PubAck`. The scheduler makes
several per pod, so here one subscription under the connection's own inbox prefix (allowed by
the bus permissions like nats-py's request inbox) receives every ack, a counter names each
publish, and a timer handle bounds the wait. The server's answer is read as nats-py reads it:
an `error` is raised as the same `APIError` subclass (a KV update at a stale revision as
`KeyWrongLastSequenceError`), no stream as `NoStreamResponseError`, no answer as
`nats.errors.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

_WRONG_LAST_SEQUENCE = (10071, 10164)  # as nats-py's KeyValue.update reads them


class JetStreamAcks:
    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self._prefix = ""
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._tokens = itertools.count(1)
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if not self._prefix:
                prefix = self.nc.new_inbox() + "."
                # No callback: nats-py's reader hands each ack to the subscription's pending
                # queue, here `_AckBox`, which settles the publish's future at once (no queue,
                # no task woken and no coroutine per ack: three acks per pod placed).
                sub = await self.nc.subscribe(prefix + "*", pending_bytes_limit=0)
                if isinstance(getattr(sub, "_pending_queue", None), asyncio.Queue):
                    sub._pending_queue = _AckBox(self._settle)  # type: ignore[assignment]
                else:  # a nats-py without that queue: its callback path
                    await sub.unsubscribe()
                    await self.nc.subscribe(prefix + "*", cb=self._on_ack)
                self._prefix = prefix

    async def _on_ack(self, msg: Msg) -> None:
        self._settle(msg)

    def _settle(self, msg: Msg) -> None:
        future = self._pending.get(msg.subject[len(self._prefix):])
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            future.set_result(json.loads(msg.data))
        except ValueError as exc:
            future.set_exception(nats.js.errors.Error(f"unreadable ack: {exc}"))

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str], timeout: float = 5.0
    ) -> dict[str, Any]:
        """The stream's ack (`{"stream": ..., "seq": ...}`), or the error nats-py raises."""
        if not self._prefix:
            await self._start()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self.nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
            ack = await future
        finally:
            timer.cancel()
            del self._pending[token]
        if "error" in ack:
            nats.js.errors.APIError.from_error(ack["error"])  # raises the matching subclass
        return ack

    async def update(self, subject: str, value: bytes, last: int) -> int:
        """`KeyValue.update(key, value, last=last)`, `subject` being the key's (`$KV.<bucket>.
        <key>`): the new revision."""
        try:
            ack = await self.publish(
                subject, value, {"Nats-Expected-Last-Subject-Sequence": str(last or 0)}
            )
        except nats.js.errors.APIError as err:
            if err.err_code in _WRONG_LAST_SEQUENCE:
                raise nats.js.errors.KeyWrongLastSequenceError(
                    description=err.description
                ) from None
            raise
        return int(ack["seq"])


def _expire(future: asyncio.Future[dict[str, Any]]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


class _AckBox:
    """Stands in for the ack subscription's pending queue (`asyncio.Queue`): what nats-py's
    reader calls on it. Each ack is settled as it is put (`settle` never raises: a publish's
    future is resolved or failed), so nothing is ever pending."""

    def __init__(self, settle: Callable[[Msg], None]) -> None:
        self.settle = settle

    def put_nowait(self, msg: Msg) -> None:
        self.settle(msg)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def full(self) -> bool:
        return False

    def get_nowait(self) -> Msg:
        raise asyncio.QueueEmpty

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        return None
