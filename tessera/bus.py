"""The bus contract: every NATS name Tessera uses, connecting, and the CAS update loop.

DESIGN §2 in code. Nothing else in the project spells a subject, bucket or stream name.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from tessera.codec import Message, decode, encode
from tessera.models import Event
from tessera.settings import NatsSettings, TesseraSettings

log = logging.getLogger("tessera.bus")

# --- KV buckets and the stream ----------------------------------------------------------------
NODES_BUCKET = "tessera-nodes"
LEDGER_BUCKET = "tessera-ledger"
QUOTA_BUCKET = "tessera-quota"
EVENTS_STREAM = "TESSERA_EVENTS"
EVENTS_PREFIX = "tessera.events"
EVENTS_ALL = f"{EVENTS_PREFIX}.>"
# Publishers retry for at most ~30 s; the dedupe window must cover the longest retry.
EVENTS_DEDUPE_WINDOW_S = 120.0
EVENTS_MAX_AGE_S = 7 * 24 * 3600.0

# --- request/reply endpoints (NATS micro services) -------------------------------------------
QUOTA_SERVICE = "tessera-quota"
QUOTA_RESERVE = "tessera.quota.reserve"
QUOTA_RELEASE = "tessera.quota.release"
QUOTA_STATUS = "tessera.quota.status"
QUOTA_SET = "tessera.quota.set"
# The quota service's durable consumer of allocation releases (shared by its replicas).
QUOTA_RELEASED_CONSUMER = "tessera-quota-released"
SCHEDULER_SERVICE = "tessera-scheduler"
SCHEDULER_EXPLAIN = "tessera.scheduler.explain"
NODE_SERVICE = "tessera-node-agent"
USAGE_ALL = "tessera.usage.>"


def subject_token(name: str) -> str:
    """Make a node/namespace name safe as one subject token ('.', '*', '>' are reserved)."""
    out = []
    for ch in name:
        if ch in ".*>%" or ch.isspace():
            out.append(f"%{ord(ch):02X}")
        else:
            out.append(ch)
    return "".join(out)


def token_name(token: str) -> str:
    """Inverse of subject_token."""
    out, i = [], 0
    while i < len(token):
        if token[i] == "%" and i + 2 < len(token) + 1:
            out.append(chr(int(token[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(token[i])
            i += 1
    return "".join(out)


def alloc_event_subject(node: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.alloc.{subject_token(node)}.{action}"


def alloc_events_filter(action: str) -> str:
    """Filter for one allocation action on every node, e.g. tessera.events.alloc.*.released."""
    return f"{EVENTS_PREFIX}.alloc.*.{action}"


def node_event_subject(node: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.node.{subject_token(node)}.{action}"


def admission_event_subject(namespace: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.admission.{subject_token(namespace)}.{action}"


def quota_event_subject(namespace: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.quota.{subject_token(namespace)}.{action}"


def oom_event_subject(node: str) -> str:
    return f"{EVENTS_PREFIX}.oom.{subject_token(node)}"


def sched_failed_subject(namespace: str) -> str:
    return f"{EVENTS_PREFIX}.sched.{subject_token(namespace)}.failed"


def sched_gone_subject(namespace: str) -> str:
    return f"{EVENTS_PREFIX}.sched.{subject_token(namespace)}.gone"


def usage_subject(node: str) -> str:
    return f"tessera.usage.{subject_token(node)}"


def node_limits_subject(node: str) -> str:
    return f"tessera.node.{subject_token(node)}.limits.set"


def event_subject(event: Event) -> str:
    """The subject an event is published on, from its own fields."""
    from tessera import models as m  # local: models imports nothing from here

    if isinstance(event, m.AllocationEvent):
        return alloc_event_subject(event.node, event.action)
    if isinstance(event, m.NodeEvent):
        return node_event_subject(event.node, event.action)
    if isinstance(event, m.AdmissionEvent):
        return admission_event_subject(event.namespace, event.action)
    if isinstance(event, m.QuotaEvent):
        return quota_event_subject(event.namespace, event.action)
    if isinstance(event, m.OomEvent):
        return oom_event_subject(event.node)
    if isinstance(event, m.SchedulingFailedEvent):
        return sched_failed_subject(event.namespace)
    if isinstance(event, m.PodGoneEvent):
        return sched_gone_subject(event.namespace)
    raise TypeError(f"no subject for {type(event).__name__}")


# --- connecting -------------------------------------------------------------------------------


async def connect(
    nats_settings: NatsSettings,
    name: str,
    *,
    initial_attempts: int = 60,
    max_backoff_s: float = 2.0,
) -> NatsClient:
    """Connect, retrying the first connection with backoff, then reconnecting forever."""
    options: dict[str, object] = {
        "servers": [u.strip() for u in nats_settings.url.split(",") if u.strip()],
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
    }
    if nats_settings.creds:
        options["user_credentials"] = nats_settings.creds
    if nats_settings.user:
        options["user"] = nats_settings.user
        options["password"] = nats_settings.password or ""
    if nats_settings.tls_ca:
        options["tls"] = ssl.create_default_context(cafile=nats_settings.tls_ca)
    backoff = 0.1
    for attempt in range(1, initial_attempts + 1):
        try:
            return await nats.connect(**options)
        except Exception as exc:
            if attempt == initial_attempts:
                raise
            log.warning("nats connect failed", extra={"attempt": attempt, "err": str(exc)})
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)
    raise RuntimeError("unreachable")


@dataclass
class Buckets:
    """The three KV buckets, bound."""

    nodes: KeyValue
    ledger: KeyValue
    quota: KeyValue


async def ensure_bus(js: JetStreamContext, settings: TesseraSettings) -> Buckets:
    """Create the buckets and the stream if missing (idempotent; safe from many services)."""
    nodes = await _ensure_kv(js, NODES_BUCKET, ttl=settings.node_ttl_s, history=1)
    ledger = await _ensure_kv(js, LEDGER_BUCKET, ttl=None, history=5)
    quota = await _ensure_kv(js, QUOTA_BUCKET, ttl=None, history=5)
    await ensure_events_stream(js)
    return Buckets(nodes=nodes, ledger=ledger, quota=quota)


async def ensure_events_stream(js: JetStreamContext) -> None:
    config = js_api.StreamConfig(
        name=EVENTS_STREAM,
        subjects=[EVENTS_ALL],
        storage=js_api.StorageType.FILE,
        duplicate_window=EVENTS_DEDUPE_WINDOW_S,
        max_age=EVENTS_MAX_AGE_S,
        discard=js_api.DiscardPolicy.OLD,
    )
    try:
        await js.stream_info(EVENTS_STREAM)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Another service created it between our check and our add.
        await js.stream_info(EVENTS_STREAM)


async def _ensure_kv(
    js: JetStreamContext, bucket: str, *, ttl: float | None, history: int
) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    config = js_api.KeyValueConfig(
        bucket=bucket, ttl=ttl, history=history, storage=js_api.StorageType.FILE
    )
    try:
        return await js.create_key_value(config)
    except BadRequestError:
        return await js.key_value(bucket)


# --- publishing -------------------------------------------------------------------------------


async def publish_event(js: JetStreamContext, event: Event, *, attempts: int = 5) -> None:
    """Publish to the event stream with Nats-Msg-Id = event_id, so retries never duplicate."""
    subject = event_subject(event)
    payload = encode(event)
    headers = {"Nats-Msg-Id": event.event_id}
    delay = 0.1
    for attempt in range(1, attempts + 1):
        try:
            await js.publish(subject, payload, headers=headers, timeout=2.0)
            return
        except Exception as exc:
            if attempt == attempts:
                raise
            log.warning("event publish failed", extra={"subject": subject, "err": str(exc)})
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


# --- compare-and-set update loop --------------------------------------------------------------

T = TypeVar("T", bound=Message)


class CasConflictError(RuntimeError):
    """The update kept losing races; nothing was written by this call."""


class NoChange(Exception):
    """Raise inside a mutate function to stop without writing."""


V = TypeVar("V")


@dataclass
class Versioned(Generic[V]):
    value: V
    revision: int


async def read(kv: KeyValue, key: str, model: type[T]) -> Versioned[T] | None:
    """The current value and its revision, or None when the key is missing or deleted."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if entry.value is None or entry.operation in ("DEL", "PURGE"):
        return None
    return Versioned(decode(entry.value, model), entry.revision)


async def cas_update(
    kv: KeyValue,
    key: str,
    model: type[T],
    mutate: Callable[[T | None], T],
    *,
    attempts: int = 25,
) -> Versioned[T]:
    """Read, mutate, write back only if nobody wrote in between; retry on conflict.

    `mutate` gets the current value (None if the key does not exist) and returns the new one. It
    may be called several times, so it must be pure. Raise NoChange to leave the value as is
    (the current value is then returned); any other exception aborts the update.
    """
    delay = 0.002
    for _ in range(attempts):
        current = await read(kv, key, model)
        try:
            new_value = mutate(current.value if current else None)
        except NoChange:
            if current is None:
                raise
            return current
        payload = encode(new_value)
        try:
            if current is None:
                revision = await kv.create(key, payload)
            else:
                revision = await kv.update(key, payload, last=current.revision)
        except KeyWrongLastSequenceError:
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(0.1, delay * 2)
            continue
        return Versioned(new_value, revision)
    raise CasConflictError(f"{key}: gave up after {attempts} conflicting writes")


async def watch_models(
    kv: KeyValue, model: type[T], on_error: Callable[[str, Exception], None] | None = None
) -> AsyncIterator[tuple[str, T | None, int]]:
    """Yield (key, value or None when deleted, revision): current values first, then changes.

    After the current values, one ("", None, 0) marker says the initial sync is complete.
    Undecodable values are reported to `on_error` and skipped, never raised.
    """
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None:
                yield "", None, 0
                continue
            if entry.operation in ("DEL", "PURGE") or entry.value is None:
                yield entry.key, None, entry.revision
                continue
            try:
                value = decode(entry.value, model)
            except Exception as exc:
                if on_error:
                    on_error(entry.key, exc)
                continue
            yield entry.key, value, entry.revision
    finally:
        await watcher.stop()
