"""The bus contract: every NATS name Tessera uses, connecting, and the CAS update loop.

DESIGN §2 in code. Nothing else in the project spells a subject, bucket or stream name.
"""

from __future__ import annotations

import asyncio
import contextlib
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
# One key per pod holding quota: `<namespace>.<pod uid>` -> QuotaCharge (see QuotaState).
QUOTA_CHARGES_BUCKET = "tessera-quota-charges"
EVENTS_STREAM = "TESSERA_EVENTS"
EVENTS_PREFIX = "tessera.events"
EVENTS_ALL = f"{EVENTS_PREFIX}.>"
# Publishers retry for at most ~30 s; the dedupe window must cover the longest retry.
EVENTS_DEDUPE_WINDOW_S = 120.0
EVENTS_MAX_AGE_S = 7 * 24 * 3600.0
# The server-time reference (tessera.clock): one tiny message per instance, stamped by the server.
CLOCK_STREAM = "TESSERA_CLOCK"
CLOCK_PREFIX = "tessera.clock"

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


def rejected_event_subject(kind: str) -> str:
    """Where a value refused by bus validation is reported (tessera.validation)."""
    return f"{EVENTS_PREFIX}.rejected.{subject_token(kind)}"


def limit_breached_subject(node: str) -> str:
    return f"{EVENTS_PREFIX}.limit.{subject_token(node)}.breached"


def mps_event_subject(node: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.mps.{subject_token(node)}.{action}"


def sched_gone_subject(namespace: str) -> str:
    return f"{EVENTS_PREFIX}.sched.{subject_token(namespace)}.gone"


def preemption_event_subject(namespace: str, action: str) -> str:
    return f"{EVENTS_PREFIX}.preemption.{subject_token(namespace)}.{action}"


def usage_subject(node: str) -> str:
    return f"tessera.usage.{subject_token(node)}"


def clock_subject(instance: str) -> str:
    return f"{CLOCK_PREFIX}.{subject_token(instance)}"


def quota_charge_key(namespace: str, pod_uid: str) -> str:
    """Key of one pod's charge in QUOTA_CHARGES_BUCKET (pod uids are KV-safe: [0-9a-f-])."""
    return f"{namespace}.{pod_uid}"


def node_limits_subject(node: str) -> str:
    return f"tessera.node.{subject_token(node)}.limits.set"


def node_config_set_subject(node: str) -> str:
    """Set (or reset) a node's local device configuration entry (admin only)."""
    return f"tessera.node.{subject_token(node)}.config.set"


def node_config_get_subject(node: str) -> str:
    """A node's applied device configuration and the last refusal."""
    return f"tessera.node.{subject_token(node)}.config.get"


def mig_event_subject(node: str, action: str) -> str:
    """Dynamic MIG instances created / destroyed / vanished on a node."""
    return f"{EVENTS_PREFIX}.mig.{subject_token(node)}.{subject_token(action)}"


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
    if isinstance(event, m.ValueRejectedEvent):
        return rejected_event_subject(event.kind)
    if isinstance(event, m.LimitBreachedEvent):
        return limit_breached_subject(event.node)
    if isinstance(event, m.PodGoneEvent):
        return sched_gone_subject(event.namespace)
    if isinstance(event, m.MigEvent):
        return mig_event_subject(event.node, event.action)
    if isinstance(event, m.PreemptionEvent):
        return preemption_event_subject(event.namespace, event.action)
    if isinstance(event, m.MpsEvent):
        return mps_event_subject(event.node, event.action)
    raise TypeError(f"no subject for {type(event).__name__}")


# --- connecting -------------------------------------------------------------------------------

INBOX_ROOT = "_INBOX"


def inbox_prefix(user: str) -> str:
    """The reply-subject prefix of an identity: its own token under _INBOX, so the server can
    let each identity read only its own replies (see tessera.bus_permissions)."""
    return f"{INBOX_ROOT}.{subject_token(user)}"



async def connect(
    nats_settings: NatsSettings,
    name: str,
    *,
    initial_attempts: int = 60,
    max_backoff_s: float = 2.0,
) -> NatsClient:
    """Connect, retrying the first connection with backoff, then reconnecting forever."""
    servers = [u.strip() for u in nats_settings.url.split(",") if u.strip()]
    if any(u.lower().startswith(("ws://", "wss://")) for u in servers):
        _bind_websocket_transport()
    options: dict[str, object] = {
        "servers": servers,
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
        options["password"] = nats_settings.resolved_password()
        options["inbox_prefix"] = inbox_prefix(nats_settings.user)
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


def _bind_websocket_transport() -> None:
    """nats-py's websocket transport needs aiohttp, which `tessera/__init__.py` keeps out of
    nats-py's import (it is a tenth of a service's start and only websockets use it): bind it
    in when a websocket URL is configured."""
    from nats.aio import transport

    if transport.aiohttp is None:
        import aiohttp
        import multidict

        transport.aiohttp, transport.multidict = aiohttp, multidict


@dataclass
class Buckets:
    """The three KV buckets, bound."""

    nodes: KeyValue
    ledger: KeyValue
    quota: KeyValue
    quota_charges: KeyValue


async def ensure_bus(js: JetStreamContext, settings: TesseraSettings) -> Buckets:
    """Create the buckets and the streams if missing (idempotent; safe from many services), with
    `settings.bus_replicas` replicas each (1 on one server; 3 on a 3-server cluster)."""
    replicas = settings.bus_replicas
    nodes = await _ensure_kv(js, NODES_BUCKET, ttl=settings.node_ttl_s, history=1,
                             replicas=replicas)  # fmt: skip
    ledger = await _ensure_kv(js, LEDGER_BUCKET, ttl=None, history=5, replicas=replicas)
    quota = await _ensure_kv(js, QUOTA_BUCKET, ttl=None, history=5, replicas=replicas)
    charges = await _ensure_kv(js, QUOTA_CHARGES_BUCKET, ttl=None, history=1, replicas=replicas)
    await ensure_events_stream(js, replicas)
    await ensure_clock_stream(js, replicas)
    return Buckets(nodes=nodes, ledger=ledger, quota=quota, quota_charges=charges)


# The streams whose loss loses state (the clock stream is in memory: it goes with every restart).
BUS_STREAMS = (
    f"KV_{NODES_BUCKET}", f"KV_{LEDGER_BUCKET}", f"KV_{QUOTA_BUCKET}",
    f"KV_{QUOTA_CHARGES_BUCKET}", EVENTS_STREAM,
)  # fmt: skip


async def ensure_events_stream(js: JetStreamContext, replicas: int = 1) -> None:
    config = js_api.StreamConfig(
        name=EVENTS_STREAM,
        subjects=[EVENTS_ALL],
        storage=js_api.StorageType.FILE,
        duplicate_window=EVENTS_DEDUPE_WINDOW_S,
        max_age=EVENTS_MAX_AGE_S,
        discard=js_api.DiscardPolicy.OLD,
        num_replicas=replicas,
    )
    await _ensure_stream(js, config)


async def ensure_clock_stream(js: JetStreamContext, replicas: int = 1) -> None:
    config = js_api.StreamConfig(
        name=CLOCK_STREAM,
        subjects=[f"{CLOCK_PREFIX}.>"],
        storage=js_api.StorageType.MEMORY,
        max_msgs_per_subject=1,
        max_age=300.0,
        discard=js_api.DiscardPolicy.OLD,
        num_replicas=replicas,
    )
    await _ensure_stream(js, config)


async def _ensure_stream(js: JetStreamContext, config: js_api.StreamConfig) -> None:
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            return
        except BadRequestError:
            # Another service created it between our check and our add.
            info = await js.stream_info(config.name)
    await _match_replicas(js, info, config.num_replicas or 1)


async def _match_replicas(js: JetStreamContext, info: js_api.StreamInfo, replicas: int) -> None:
    """Raise (or lower) an existing stream's replica count to the configured one."""
    if (info.config.num_replicas or 1) == replicas:
        return
    try:
        await js.update_stream(info.config.evolve(num_replicas=replicas))
    except Exception as exc:  # the cluster may be short of servers: keep serving, say so
        log.warning("stream replicas not changed", extra={"stream": info.config.name,
                                                          "want": replicas, "err": str(exc)})


async def _ensure_kv(
    js: JetStreamContext, bucket: str, *, ttl: float | None, history: int, replicas: int = 1
) -> KeyValue:
    try:
        kv = await js.key_value(bucket)
        await _match_replicas(js, await js.stream_info(f"KV_{bucket}"), replicas)
        return kv
    except BucketNotFoundError:
        pass
    config = js_api.KeyValueConfig(
        bucket=bucket, ttl=ttl, history=history, storage=js_api.StorageType.FILE,
        replicas=replicas,
    )  # fmt: skip
    try:
        return await js.create_key_value(config)
    except BadRequestError:
        return await js.key_value(bucket)


class BusKeeper:
    """Keeps the buckets and streams in existence: a service whose NATS lost its store (a wiped
    disk, a cluster that lost a replica set) re-creates them, and reports not-ready while it
    cannot. `generation` grows each time a stream is found re-created (by us or another
    service), so watchers restart and state that lived only in NATS is rebuilt. Call `check()`
    once right after `ensure_bus`, before watching: that is the bus later checks compare to."""

    CHECK_TIMEOUT_S = 5.0  # a check stuck in a reconnect counts as failed

    def __init__(self, js: JetStreamContext, settings: TesseraSettings) -> None:
        self.js = js
        self.settings = settings
        self.ready = False
        self.generation = 0
        self.reason = "bus not checked yet"
        self.changed = asyncio.Event()  # set on every generation change; waiters clear it
        self._created: dict[str, object] = {}

    async def check(self) -> bool:
        """Ensure everything exists; True when it does. Bumps `generation` on a re-creation."""
        try:
            created = await self._bounded_ensure()
        except Exception as exc:
            nc = getattr(self.js, "_nc", None)
            if isinstance(exc, TimeoutError) and nc is not None and nc.is_connected:
                # Connected but slow (a busy process or server): not evidence of a lost bus.
                log.warning("bus check slow", extra={"err": str(exc)})
                return self.ready
            if self.ready:
                log.warning("bus unavailable", extra={"err": f"{type(exc).__name__}: {exc}"})
            self.ready = False
            self.reason = f"NATS buckets/streams unavailable: {type(exc).__name__}: {exc}"[:300]
            return False
        if self._created and created != self._created:
            self.generation += 1
            self.changed.set()
            log.warning("bus re-created", extra={"generation": self.generation})
        self._created = created
        self.ready = True
        self.reason = ""
        return True

    async def _bounded_ensure(self) -> dict[str, object]:
        """`_ensure` with a deadline that holds even when a request caught in a reconnect does
        not honour cancellation (seen with nats-py): the stuck attempt is abandoned."""
        attempt = asyncio.ensure_future(self._ensure())
        done, _ = await asyncio.wait({attempt}, timeout=self.CHECK_TIMEOUT_S)
        if not done:
            attempt.cancel()
            attempt.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise TimeoutError(f"no answer in {self.CHECK_TIMEOUT_S:.0f} s")
        return attempt.result()

    async def _ensure(self) -> dict[str, object]:
        await ensure_bus(self.js, self.settings)
        return {name: (await self.js.stream_info(name)).created for name in BUS_STREAMS}

    async def run(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        while not stop.is_set():
            await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


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


# --- watching ---------------------------------------------------------------------------------
#
# nats-py's KV watcher puts its None "initial values done" marker first when, at creation, the
# consumer reported nothing pending and the subscription had received nothing. Under load that
# is also true while the server has already delivered every current value and they are still on
# their way to the client: the marker then comes BEFORE all of them (a listing of 300 keys came
# back empty). So the marker is never believed alone: nats-py's leading marker only when the
# consumer has delivered nothing; otherwise ours follows the first entry the server sent with
# nothing left pending (`delta == 0`), i.e. once every value it held at creation was yielded.

WATCH_INFO_ATTEMPTS = 5


class WatchSyncError(RuntimeError):
    """Whether a watch's initial values are complete could not be established (the watch
    stops; callers watch again rather than act on a listing that may be incomplete)."""


async def watch_entries(
    kv: KeyValue, keys: str = ">", *, include_history: bool = False
) -> AsyncIterator[KeyValue.Entry | None]:
    """The raw entries of a KV watch (deletes included): current values first, then one None
    once every one of them has been yielded, then changes. The watch stops when the generator
    is closed (use `contextlib.aclosing` or `aclose()`)."""
    watcher = await kv.watch(keys, include_history=include_history)
    synced = False
    first = True
    try:
        async for entry in watcher:
            leading, first = first, False
            if entry is None:
                # nats-py puts a marker behind the message it received with nothing pending
                # (true), or first of all at creation (true only if nothing was delivered).
                if not synced and (not leading or await _delivered(watcher) == 0):
                    synced = True
                    yield None
                continue
            yield entry
            if not synced and entry.delta == 0:
                synced = True
                yield None
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()


async def _delivered(watcher: KeyValue.KeyWatcher) -> int:
    """How many messages the server has delivered to the watch's consumer so far."""
    delay = 0.1
    for attempt in range(1, WATCH_INFO_ATTEMPTS + 1):
        try:
            info = await watcher._sub.consumer_info()  # type: ignore[union-attr]
            return int(info.delivered.consumer_seq or 0) if info.delivered else 0
        except Exception as exc:
            if attempt == WATCH_INFO_ATTEMPTS:
                raise WatchSyncError(
                    f"watch consumer unreadable: {type(exc).__name__}: {exc}"
                ) from exc
            await asyncio.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


async def list_entries(
    kv: KeyValue, keys: str = ">", *, include_history: bool = False, yield_every: int = 200
) -> list[KeyValue.Entry]:
    """Every entry a watch of `keys` starts with (the current values, or with `include_history`
    every revision), in stream order. Yields to the event loop every `yield_every` entries: a
    long listing is a background pass and must let requests in between."""
    out: list[KeyValue.Entry] = []
    async with contextlib.aclosing(watch_entries(kv, keys, include_history=include_history)) as it:
        async for entry in it:
            if entry is None:
                break
            out.append(entry)
            if len(out) % yield_every == 0:
                await asyncio.sleep(0)
    return out


async def history(kv: KeyValue, key: str) -> list[KeyValue.Entry]:
    """Every stored revision of one key, oldest first; KeyNotFoundError when there is none
    (`KeyValue.history` trusts nats-py's marker and can answer "none" for a key that has)."""
    entries = await list_entries(kv, key, include_history=True)
    if not entries:
        raise KeyNotFoundError
    return entries


async def watch_models(
    kv: KeyValue, model: type[T], on_error: Callable[[str, Exception], None] | None = None
) -> AsyncIterator[tuple[str, T | None, int]]:
    """Yield (key, value or None when deleted, revision): current values first, then changes.

    After the current values, one ("", None, 0) marker says the initial sync is complete (every
    current value was yielded before it: see `watch_entries`).
    Undecodable values are reported to `on_error` and skipped, never raised.
    """
    async with contextlib.aclosing(watch_entries(kv)) as entries:
        async for entry in entries:
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
