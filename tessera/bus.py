"""The bus contract: every NATS name Tessera uses, connecting, and the CAS update loop.

DESIGN §2 in code. Nothing else in the project spells a subject, bucket or stream name.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
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


def memory_event_subject(node: str, action: str) -> str:
    """Elastic memory reclaimed from a borrower, or a borrower evicted, on a node."""
    return f"{EVENTS_PREFIX}.memory.{subject_token(node)}.{subject_token(action)}"


def compute_event_subject(node: str, action: str) -> str:
    """Elastic compute lent beyond a guarantee taken back (coalesced), on a node."""
    return f"{EVENTS_PREFIX}.compute.{subject_token(node)}.{subject_token(action)}"


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
    if isinstance(event, m.MemoryReclaimEvent):
        return memory_event_subject(event.node, event.action)
    if isinstance(event, m.ComputeReclaimEvent):
        return compute_event_subject(event.node, event.action)
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


async def flush(nc: NatsClient) -> None:
    """Return once the server has processed everything this connection sent before the call (a
    subscription just made included), so that what another connection publishes next reaches
    it. `nc.flush()` alone does not promise that: nats-py (2.16) writes its PING straight to the
    socket, ahead of the commands still queued for the client's flusher task (a SUB just made),
    so its PONG may come back before the server has read the SUB, and a request another
    connection makes at once gets "no responders" (seen on a busy host). While the first round
    trip is under way the flusher writes what was queued; the second PING follows it."""
    await nc.flush()
    await nc.flush()


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


# NATS away for a moment (the server restarting, JetStream not serving yet): worth retrying.
# nats.errors.TimeoutError is a TimeoutError.
_BUS_AWAY: tuple[type[BaseException], ...] = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    ServiceUnavailableError,
)
_Result = TypeVar("_Result")


async def while_bus_away(
    what: str,
    step: Callable[[], Awaitable[_Result]],
    *,
    attempts: int = 60,
    max_backoff_s: float = 2.0,
) -> _Result:
    """Run a start-up step that needs NATS to answer, retrying with backoff while NATS is away
    (a timeout, no responders, JetStream unavailable), for about as long as the first connect
    is retried (`connect`); any other error (a permission, a bad config) is raised at once. A
    service started just as NATS restarts must wait for it, not exit: nothing restarts it in
    the local stack, and Kubernetes would only after a CrashLoopBackOff delay."""
    backoff = 0.1
    for attempt in range(1, attempts + 1):
        try:
            return await step()
        except _BUS_AWAY as exc:
            if attempt == attempts:
                raise
            log.warning("bus not answering at start, retrying", extra={
                "step": what, "attempt": attempt, "err": f"{type(exc).__name__}: {exc}",
            })  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)
    raise RuntimeError("unreachable")


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
# A KV watch is an ordered push consumer of the bucket's stream (what nats-py's `KeyValue.watch`
# creates), read here straight off its subscription: nats-py's watcher built a metadata object
# with two dataclasses and a datetime per message and passed each through two queues and a task
# (15 % of the scheduler's time to ready went to delivering 10,000 values). What an ordered
# consumer promises is kept, and checked here rather than assumed:
#
# - every delivery carries its consumer sequence; one that does not follow the last taken (a
#   message lost between server and client), or an idle heartbeat naming a later one (the lost
#   message was the last), replaces the consumer by one starting right after the last stream
#   sequence taken, so nothing is skipped and nothing taken twice; so does a silence longer
#   than two heartbeats (the consumer is gone: the server restarted);
# - flow control is answered only when every message before the request has been taken (the
#   server then never runs ahead of the reader by more than its window);
# - "initial values done" (one None) follows the first delivery that had nothing pending behind
#   it, i.e. every value the bucket held when the watch began has been yielded before it. Only
#   a consumer that at creation had delivered nothing and had nothing pending is empty at once.
#   (nats-py's watcher put its marker first whenever a consumer-info answer overtook deliveries
#   already on their way: a listing of 300 keys came back empty under load.)
# The JetStream API subjects are nats-py's own (CONSUMER.CREATE.<stream>, $JS.FC replies), so
# tessera.bus_permissions' KV watch rule is unchanged.

WATCH_HEARTBEAT_S = 5.0
_STATUS = "Status"
_KV_OP = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"  # nats-server 2.11+: TTL/age expiry markers
_MARKER_OPS = {"MaxAge": "PURGE", "Purge": "PURGE", "Remove": "DEL"}


class WatchSyncError(RuntimeError):
    """A watch could not be (re)started; the caller watches again from the start."""


class KvEntry:
    """One value (or delete) of a KV watch, with the attributes of nats-py's `KeyValue.Entry`.
    `created` (the server's timestamp) is built only when read; `created_s` is it in epoch
    seconds."""

    __slots__ = ("_stamp_ns", "bucket", "delta", "key", "operation", "revision", "value")

    def __init__(
        self, bucket: str, key: str, value: bytes | None, revision: int, delta: int,
        operation: str | None, stamp_ns: int,
    ) -> None:  # fmt: skip
        self.bucket = bucket
        self.key = key
        self.value = value
        self.revision = revision
        self.delta = delta
        self.operation = operation
        self._stamp_ns = stamp_ns

    @property
    def created_s(self) -> float:
        return self._stamp_ns / 1e9

    @property
    def created(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self._stamp_ns / 1e9, datetime.UTC)

    def __repr__(self) -> str:
        return (f"KvEntry({self.bucket!r}, {self.key!r}, rev={self.revision}, "
                f"op={self.operation}, delta={self.delta})")  # fmt: skip


class _Inbox:
    """Stands in for a nats-py subscription's pending queue (`asyncio.Queue`): what nats-py's
    reader calls on it, without a queue's locking and futures per message."""

    def __init__(self, arrived: asyncio.Event) -> None:
        self.box: collections.deque[Msg] = collections.deque()
        self.arrived = arrived

    def put_nowait(self, msg: Msg) -> None:
        self.box.append(msg)
        self.arrived.set()

    async def take(self, msg: Msg) -> None:
        self.put_nowait(msg)

    def get_nowait(self) -> Msg:
        return self.box.popleft()

    def qsize(self) -> int:
        return len(self.box)

    def empty(self) -> bool:
        return not self.box

    def full(self) -> bool:
        return False

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


class _OrderedWatch:
    """The consumer behind `watch_entries` (see the notes above)."""

    def __init__(self, kv: KeyValue, keys: str, include_history: bool, heartbeat_s: float,
                 inactive_s: float = 300.0) -> None:  # fmt: skip
        self.inactive_s = inactive_s  # how long the server keeps the consumer once unwatched
        # nats-py keeps these on the KeyValue without public accessors.
        self.js: JetStreamContext = kv._js  # type: ignore[attr-defined]
        self.nc: NatsClient = self.js._nc  # type: ignore[attr-defined]
        self.stream: str = kv._stream  # type: ignore[attr-defined]
        self.prefix: str = kv._pre  # type: ignore[attr-defined]
        self.bucket: str = kv._name  # type: ignore[attr-defined]
        self.subject = f"{self.prefix}{keys}"
        self.include_history = include_history
        self.heartbeat_s = heartbeat_s
        self.sub: Subscription | None = None
        self.box: collections.deque[Msg] = collections.deque()
        self.arrived = asyncio.Event()
        self.dseq = 0  # consumer sequence of the last delivery taken from this consumer
        self.sseq = 0  # stream sequence of the last delivery taken (from any consumer)
        self.resets = 0

    async def subscribe(self) -> js_api.ConsumerInfo:
        """A consumer delivering every value (or, after a reset, everything after `sseq`)."""
        inbox = self.nc.new_inbox()
        box = _Inbox(self.arrived)
        # No callback (no task per subscription, no coroutine per message) and no byte limit
        # (flow control bounds what is outstanding): nats-py's reader puts each delivery into
        # the subscription's pending queue, here a deque the watch reads in order.
        sub = await self.nc.subscribe(inbox, pending_bytes_limit=0)
        if isinstance(getattr(sub, "_pending_queue", None), asyncio.Queue):
            sub._pending_queue = box  # type: ignore[assignment]  # before anything is delivered
        else:  # a nats-py without that queue: its callback path, one coroutine per message
            await sub.unsubscribe()
            sub = await self.nc.subscribe(inbox, cb=box.take, pending_bytes_limit=0)
        config = js_api.ConsumerConfig(
            deliver_subject=inbox, filter_subject=self.subject,
            ack_policy=js_api.AckPolicy.NONE, max_deliver=1, ack_wait=22 * 3600,
            flow_control=True, idle_heartbeat=self.heartbeat_s, num_replicas=1,
            mem_storage=True, inactive_threshold=self.inactive_s,
        )  # fmt: skip
        if self.sseq:
            config.deliver_policy = js_api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.sseq + 1
        elif not self.include_history:
            config.deliver_policy = js_api.DeliverPolicy.LAST_PER_SUBJECT
        try:
            info = await self._add_consumer(config)
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise
        self.sub, self.box, self.dseq = sub, box.box, 0
        return info

    async def _add_consumer(self, config: js_api.ConsumerConfig) -> js_api.ConsumerInfo:
        """The consumer, waiting while the stream is at its consumer limit (nats-server 2.15:
        1,000 a stream by default; a burst of listings fills it until the older ones lapse,
        `LISTING_INACTIVE_S` after each): a listing is slower then, never refused."""
        deadline = asyncio.get_running_loop().time() + CONSUMER_ROOM_WAIT_S
        delay = 0.05
        while True:
            try:
                return await self.js.add_consumer(self.stream, config=config)
            except BadRequestError as exc:
                if (getattr(exc, "err_code", None) != _MAX_CONSUMERS_ERR
                        or asyncio.get_running_loop().time() + delay > deadline):  # fmt: skip
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def reset(self, why: str) -> None:
        """Replace the consumer by one that starts after the last stream sequence taken."""
        self.resets += 1
        log.info("kv watch restarted", extra={"bucket": self.bucket, "why": why,
                                              "after": self.sseq})  # fmt: skip
        await self.close()
        delay = 0.1
        while True:
            try:
                await self._check_not_made_anew()
                await self.subscribe()
                return
            except WatchSyncError:
                raise
            except Exception as exc:
                if self.nc.is_closed:
                    raise WatchSyncError(f"{self.bucket}: connection closed") from exc
                log.warning("kv watch not restarted yet", extra={"bucket": self.bucket,
                                                                  "err": str(exc)})  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _check_not_made_anew(self) -> None:
        """A stream that holds less than was taken from it was made anew (NATS lost its store):
        resuming after `sseq` would skip every value the new store has until it grows past
        it. The caller watches again from the start (current values, then the sync marker)."""
        if not self.sseq:
            return
        info = await self.js.stream_info(self.stream)
        if info.state.last_seq < self.sseq:
            raise WatchSyncError(
                f"{self.bucket}: the stream ends at {info.state.last_seq}, before the "
                f"{self.sseq} already taken (made anew): watch again from the start"
            )

    async def close(self) -> None:
        sub, self.sub = self.sub, None
        self.box = collections.deque()
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def control(self, msg: Msg, status: str) -> None:
        """A status message: heartbeat (a lost last delivery shows here) or flow control."""
        headers = msg.headers or {}
        if status != "100":  # e.g. 409 consumer deleted
            await self.reset(f"status {status} {headers.get('Description', '')}".strip())
            return
        if msg.reply:  # flow control: every message sent before it has been taken
            await self.nc.publish(msg.reply)
            return
        stalled = headers.get("Nats-Consumer-Stalled")
        if stalled:
            await self.nc.publish(stalled)
        last = headers.get("Nats-Last-Consumer")
        if last is not None and int(last) != self.dseq:
            await self.reset(f"heartbeat names delivery {last}, last taken {self.dseq}")

    async def entries(self) -> AsyncIterator[KvEntry | None]:
        info = await self.subscribe()
        synced = False
        delivered = info.delivered.consumer_seq if info.delivered else 0
        if not info.num_pending and not delivered:
            synced = True
            yield None
        quiet_s = 2 * self.heartbeat_s + 1.0
        prefix_len = len(self.prefix)
        bucket = self.bucket
        while True:
            box = self.box
            if not box:
                self.arrived.clear()
                task = asyncio.current_task()
                cancels = task.cancelling() if task is not None else 0
                try:
                    await asyncio.wait_for(self.arrived.wait(), quiet_s)
                except TimeoutError:
                    await self.reset(f"nothing heard for {quiet_s:.0f} s")
                if task is not None and task.cancelling() > cancels:
                    # Python 3.11's wait_for returns an arrival that raced a cancel and drops
                    # the cancel: this loop (and its consumer) would outlive the task.cancel()
                    # meant to stop it
                    raise asyncio.CancelledError
                continue
            msg = box.popleft()
            headers = msg.headers
            operation = None
            if headers:
                status = headers.get(_STATUS)
                if status is not None:
                    await self.control(msg, status)
                    continue
                operation = headers.get(_KV_OP)
                if operation is None and _MARKER_REASON in headers:
                    operation = _MARKER_OPS.get(headers[_MARKER_REASON], "?")
            tokens = msg.reply.split(".")
            if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<dseq>.<ns>.<pending>
                sseq, dseq, stamp, pending = tokens[5], tokens[6], tokens[7], tokens[8]
            elif len(tokens) >= 11:  # $JS.ACK.<domain>.<account>.<stream>.<consumer>.<n>...
                sseq, dseq, stamp, pending = tokens[7], tokens[8], tokens[9], tokens[10]
            else:
                await self.reset(f"not a JetStream delivery: {msg.reply[:80]!r}")
                continue
            if int(dseq) != self.dseq + 1:
                await self.reset(f"delivery {dseq} after {self.dseq}")
                continue
            self.dseq += 1
            self.sseq = int(sseq)
            delta = int(pending)
            if operation != "?":  # an expiry marker of a kind this code does not know
                yield KvEntry(bucket, msg.subject[prefix_len:], msg.data, self.sseq, delta,
                              operation, int(stamp))  # fmt: skip
            if not synced and delta == 0:
                synced = True
                yield None


async def watch_entries(
    kv: KeyValue, keys: str = ">", *, include_history: bool = False,
    heartbeat_s: float = WATCH_HEARTBEAT_S, inactive_s: float = 300.0,
) -> AsyncIterator[KvEntry | None]:
    """The raw entries of a KV watch (deletes included): current values first, then one None
    once every one of them has been yielded, then changes. The watch stops when the generator
    is closed (use `contextlib.aclosing` or `aclose()`). `inactive_s`: how long the server keeps
    the consumer after the watch stops (a long watch rides out a reconnect on it)."""
    watch = _OrderedWatch(kv, keys, include_history, heartbeat_s, inactive_s)
    try:
        async with contextlib.aclosing(watch.entries()) as entries:
            async for entry in entries:
                yield entry
    finally:
        await watch.close()


LISTING_INACTIVE_S = 2.0  # a listing's consumer, once the listing is done (list_entries)
CONSUMER_ROOM_WAIT_S = 30.0  # how long a watch or listing waits for room under the limit
_MAX_CONSUMERS_ERR = 10026  # JetStream: "maximum consumers limit reached"


async def list_entries(
    kv: KeyValue, keys: str = ">", *, include_history: bool = False, yield_every: int = 200
) -> list[KvEntry]:
    """Every entry a watch of `keys` starts with (the current values, or with `include_history`
    every revision), in stream order. Yields to the event loop every `yield_every` entries: a
    long listing is a background pass and must let requests in between.

    Its consumer goes `LISTING_INACTIVE_S` after the listing (clients may not delete consumers:
    bus_permissions). nats-server 2.15 allows 1,000 consumers per stream by default; at the
    watches' 300 s, more than 1,000 listings of one bucket in five minutes (the quota service
    lists a namespace's charges for each status and reconcile) were refused ("maximum consumers
    limit reached") until the oldest lapsed."""
    out: list[KvEntry] = []
    async with contextlib.aclosing(watch_entries(kv, keys, include_history=include_history,
                                                 inactive_s=LISTING_INACTIVE_S)) as it:
        async for entry in it:
            if entry is None:
                break
            out.append(entry)
            if len(out) % yield_every == 0:
                await asyncio.sleep(0)
    return out


async def history(kv: KeyValue, key: str) -> list[KvEntry]:
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
