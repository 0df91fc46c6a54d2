"""Helpers for the quota tests (a module name no other test area uses)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from nats.aio.client import Client as NatsClient

from tessera.codec import Message, decode, encode, peek_schema
from tessera.events import subscribe
from tessera.models import ErrorReply, QuotaReply


async def call(nc: NatsClient, subject: str, body: Message | bytes, timeout: float = 5.0) -> Any:
    """Request/reply: QuotaReply or ErrorReply, whichever came back."""
    payload = body if isinstance(body, bytes) else encode(body)
    msg = await nc.request(subject, payload, timeout=timeout)
    schema, _ = peek_schema(msg.data)
    return decode(msg.data, ErrorReply if schema == "ErrorReply" else QuotaReply)


def unique_namespace(prefix: str = "ns") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def next_event(nc: NatsClient, subject: str, timeout: float = 5.0) -> Any:
    """The first event on `subject` (from the start of the stream)."""

    stream = subscribe(nc, subject)
    try:
        received = await asyncio.wait_for(anext(stream), timeout)
        return received.event
    finally:
        await stream.aclose()


async def eventually(check: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Await `check()` until it returns something truthy; fail after `timeout` (generous: the
    checks wait on the service's background work, which a busy host holds up)."""

    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {result!r})")
        await asyncio.sleep(interval)
