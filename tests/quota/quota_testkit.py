"""Helpers for the quota tests (a module name no other test area uses)."""

from __future__ import annotations

import uuid
from typing import Any

from nats.aio.client import Client as NatsClient

from tessera.codec import Message, decode, encode, peek_schema
from tessera.models import ErrorReply, QuotaReply


async def call(nc: NatsClient, subject: str, body: Message | bytes, timeout: float = 5.0) -> Any:
    """Request/reply: QuotaReply or ErrorReply, whichever came back."""
    payload = body if isinstance(body, bytes) else encode(body)
    msg = await nc.request(subject, payload, timeout=timeout)
    schema, _ = peek_schema(msg.data)
    return decode(msg.data, ErrorReply if schema == "ErrorReply" else QuotaReply)


def unique_namespace(prefix: str = "ns") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
