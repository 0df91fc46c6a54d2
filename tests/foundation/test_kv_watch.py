"""A KV watch's "initial values done" marker must follow every current value, and a watch
that misses a delivery must notice and recover it.

nats-py puts that marker first when, at the watch's creation, the consumer reports nothing
pending and the client has received nothing yet. On a loaded machine that is also the state
while the server has already delivered every value and they are still on their way (a listing
of 300 keys came back empty). `ReorderingProxy` reproduces that state deterministically against
the real nats-server: a TCP proxy speaking the NATS protocol that holds the watch's deliveries
back until the answer to the client's consumer-info request (nats-py's watcher) or consumer-create
request (tessera.bus's) has passed them and the client has acted on it (what the server itself
does when its API answer overtakes the consumer's send queue and the deliveries follow a moment
later). It also drops a chosen delivery, as a lost message would be: tessera.bus's watch must
see the gap in the consumer sequence (or, for the last one, in the idle heartbeat) and replace
its consumer from the last stream sequence it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from tessera.quota.store import QuotaStore

from tessera import bus
from tessera.bus import connect, watch_entries, watch_models
from tessera.codec import encode
from tessera.models import QuotaCharge, QuotaState
from tessera.settings import NatsSettings

KEYS = 300
Fresh = Callable[[], Awaitable[KeyValue]]


class ReorderingProxy:
    """NATS protocol proxy. `hold(n)`: keep the next JetStream deliveries (messages with a
    `$JS.ACK.` reply subject) and the client's next consumer-info request until `n` deliveries
    are held, then let the request through; once its answer has reached the client, send the
    held deliveries when the client next sends anything (or after RELEASE_AFTER_S)."""

    RELEASE_AFTER_S = 1.0

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self._want = 0
        self._create = False  # hold the consumer-create answer (not the info request)
        self._held_answer: tuple[asyncio.StreamWriter, bytes] | None = None
        self._drop_at = 0
        self._deliveries = 0
        self.dropped = 0
        self.creates = 0  # consumer-create requests the client sent
        self._held: list[bytes] = []
        self._info_request: tuple[asyncio.StreamWriter, bytes] | None = None
        self._waiting_answer = False
        self._answered: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.reordered = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    def hold(self, deliveries: int, *, create: bool = False) -> None:
        """`create`: hold the answer to the next consumer-create request with the deliveries,
        then pass it to the client before them (tessera.bus's watch asks no consumer info)."""
        self._want = deliveries
        self._create = create

    def drop(self, nth: int) -> None:
        """Lose the `nth` JetStream delivery from now (1 = the next one)."""
        self._drop_at, self._deliveries = nth, 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        for coro in (self._pump(reader, up_writer, to_server=True),
                     self._pump(up_reader, writer, to_server=False)):  # fmt: skip
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, to_server: bool
    ) -> None:
        try:
            while True:
                frame, args = await _read_frame(reader)
                if to_server:
                    self._to_server(writer, frame, args)
                else:
                    self._to_client(writer, frame, args)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def _to_server(self, writer: asyncio.StreamWriter, frame: bytes, args: list[bytes]) -> None:
        self._send_held()
        if args[0] in (b"PUB", b"HPUB") and b".CONSUMER.CREATE." in args[1]:
            self.creates += 1
        if (self._want and not self._create and args[0] in (b"PUB", b"HPUB")
                and b".CONSUMER.INFO." in args[1]):  # fmt: skip
            self._info_request = (writer, frame)
            self._release_request()
            return
        writer.write(frame)

    def _to_client(self, writer: asyncio.StreamWriter, frame: bytes, args: list[bytes]) -> None:
        reply = _reply_subject(args)
        delivery = reply.startswith(b"$JS.ACK.")
        if delivery and self._drop_at:
            self._deliveries += 1
            if self._deliveries == self._drop_at:
                self._drop_at = 0
                self.dropped += 1
                return
        if self._want and delivery:
            self._held.append(frame)
            self._release_request()
            return
        if self._want and self._create and b"consumer_create_response" in frame:
            self._held_answer = (writer, frame)
            self._release_request()
            return
        writer.write(frame)
        if self._waiting_answer and b"consumer_info_response" in frame:
            self._waiting_answer = False
            self._want = 0
            self._answered = writer
            asyncio.get_running_loop().call_later(self.RELEASE_AFTER_S, self._send_held)

    def _send_held(self) -> None:
        if self._answered is None:
            return
        for held in self._held:
            self._answered.write(held)
        self.reordered = len(self._held)
        self._held.clear()
        self._answered = None

    def _release_request(self) -> None:
        if self._held_answer is not None and len(self._held) >= self._want:
            writer, frame = self._held_answer
            self._held_answer = None
            self._want = 0
            writer.write(frame)  # the answer first, the deliveries it overtook after it
            self._answered = writer
            asyncio.get_running_loop().call_later(self.RELEASE_AFTER_S, self._send_held)
            return
        if self._info_request is not None and len(self._held) >= self._want:
            writer, frame = self._info_request
            self._info_request = None
            self._waiting_answer = True
            writer.write(frame)


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, list[bytes]]:
    """One protocol frame (control line, plus payload for [H]MSG / [H]PUB) and its tokens."""
    line = await reader.readuntil(b"\r\n")
    args = line.split()
    op = args[0].upper() if args else b""
    args[:1] = [op]
    if op in (b"MSG", b"HMSG", b"PUB", b"HPUB"):
        payload = await reader.readexactly(int(args[-1]) + 2)
        return line + payload, args
    return line, args


def _reply_subject(args: list[bytes]) -> bytes:
    # MSG subject sid [reply] size / HMSG subject sid [reply] hdr_size size
    if args[0] == b"MSG" and len(args) == 5:
        return args[3]
    if args[0] == b"HMSG" and len(args) == 6:
        return args[3]
    return b""


@pytest.fixture
async def proxied(nats_server: object) -> AsyncIterator[tuple[ReorderingProxy, Fresh]]:
    port = int(nats_server.url.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    proxy = ReorderingProxy(port)
    await proxy.start()
    nc = await connect(NatsSettings(NATS_URL=f"nats://127.0.0.1:{proxy.port}"), name="reorder")
    js = nc.jetstream()
    made: list[str] = []

    async def fresh() -> KeyValue:
        made.append(f"watch-{uuid.uuid4().hex[:12]}")
        return await js.create_key_value(bucket=made[-1], history=8)

    try:
        yield proxy, fresh
    finally:
        for name in made:
            with contextlib.suppress(Exception):
                await js.delete_key_value(name)
        await nc.close()
        await proxy.stop()


async def _fill(kv: object, prefix: str, model: object) -> set[str]:
    keys = {f"{prefix}.k{i:03d}" for i in range(KEYS)}
    await asyncio.gather(*(kv.put(k, encode(model)) for k in keys))  # type: ignore[attr-defined]
    return keys


async def _until_marker(stream: AsyncIterator[tuple[str, object, int]]) -> set[str]:
    listed: set[str] = set()
    async with asyncio.timeout(20):
        async for key, _value, _revision in stream:
            if key == "":
                return listed
            listed.add(key)
    raise AssertionError("the watch ended without a marker")


async def test_the_proxy_provokes_nats_py_early_marker(proxied) -> None:
    """The condition itself: nats-py's own watcher says "done" before any of the values."""
    proxy, fresh = proxied
    kv = await fresh()
    keys = await _fill(kv, "early", QuotaState(namespace="early"))
    proxy.hold(KEYS)
    watcher = await kv.watchall()
    try:
        async with asyncio.timeout(20):
            first = await watcher.updates(timeout=20)
            rest = [await watcher.updates(timeout=20) for _ in range(KEYS)]
    finally:
        await watcher.stop()
    assert proxy.reordered == KEYS
    assert first is None  # nats-py's "initial values done", before all 300
    assert {e.key for e in rest if e is not None} == keys


async def test_watch_models_marker_follows_every_current_value(proxied) -> None:
    proxy, fresh = proxied
    kv = await fresh()
    keys = await _fill(kv, "models", QuotaState(namespace="models"))
    proxy.hold(KEYS, create=True)
    stream = watch_models(kv, QuotaState)
    try:
        listed = await _until_marker(stream)
    finally:
        await stream.aclose()
    assert listed == keys  # the old watch_models listed none of them
    assert proxy.reordered == KEYS


async def test_listing_history_and_quota_charges_are_complete(proxied) -> None:
    proxy, fresh = proxied
    charges = await fresh()
    charge = QuotaCharge(pod_uid="p", gpus=1, memory_mib=1024, cores=10, at=1.0)
    keys = await _fill(charges, "ns-list", charge)
    store = QuotaStore(await fresh(), charges, clock=lambda: 2.0)
    proxy.hold(KEYS, create=True)
    listed = await store.list_charges("ns-list")
    assert proxy.reordered == KEYS
    assert {f"ns-list.{uid}" for uid in listed} == keys

    kv = await fresh()
    for i in range(5):
        await kv.put("hist", encode(QuotaState(namespace=f"v{i}")))
    proxy.hold(5, create=True)
    revisions = await bus.history(kv, "hist")
    assert proxy.reordered == 5
    assert len(revisions) == 5
    with pytest.raises(KeyNotFoundError):
        await bus.history(kv, "never-written")


async def test_an_empty_watch_is_synced_at_once_then_follows_changes(proxied) -> None:
    """The leading marker is believed when the consumer had nothing to deliver."""
    _proxy, fresh = proxied
    kv = await fresh()
    entries = watch_entries(kv)
    try:
        async with asyncio.timeout(20):
            assert await anext(entries) is None
            await kv.put("a", encode(QuotaState(namespace="a")))
            entry = await anext(entries)
    finally:
        await entries.aclose()
    assert entry is not None and entry.key == "a"


async def _listing(entries: AsyncIterator[object]) -> list[str]:
    """The keys a watch yields before its "initial values done" marker, in order."""
    keys: list[str] = []
    async with asyncio.timeout(20):
        async for entry in entries:
            if entry is None:
                return keys
            keys.append(entry.key)  # type: ignore[attr-defined]
    raise AssertionError("the watch ended without a marker")


async def test_a_lost_delivery_is_detected_and_delivered_again(proxied) -> None:
    """Delivery 150 of 300 never reaches the client: the next one's consumer sequence shows the
    gap, the watch takes a new consumer from the last value it took, and lists each key once."""
    proxy, fresh = proxied
    kv = await fresh()
    keys = await _fill(kv, "gap", QuotaState(namespace="gap"))
    proxy.drop(150)
    entries = watch_entries(kv)
    try:
        listed = await _listing(entries)
    finally:
        await entries.aclose()
    assert proxy.dropped == 1
    assert proxy.creates == 2  # the watch's consumer, and the one that replaced it
    assert sorted(listed) == sorted(keys)  # every key, none twice


async def test_a_lost_last_delivery_shows_in_the_heartbeat(proxied) -> None:
    """The lost delivery is the last of the listing (the one with nothing pending behind it):
    no later delivery shows the gap, the idle heartbeat's last consumer sequence does, and the
    marker comes only after that value."""
    proxy, fresh = proxied
    kv = await fresh()
    keys = await _fill(kv, "tail", QuotaState(namespace="tail"))
    proxy.drop(KEYS)
    entries = watch_entries(kv, heartbeat_s=0.5)
    try:
        listed = await _listing(entries)
    finally:
        await entries.aclose()
    assert proxy.dropped == 1 and proxy.creates == 2
    assert sorted(listed) == sorted(keys)


async def test_values_written_during_a_listing_with_a_gap_are_not_lost(proxied) -> None:
    """Puts, new keys and deletes race with the listing while a delivery is lost: the values
    yielded (listing, then changes) end exactly as the bucket is, with one value per revision."""
    proxy, fresh = proxied
    kv = await fresh()
    keys = await _fill(kv, "race", QuotaState(namespace="race"))
    expected: dict[str, bytes] = dict.fromkeys(keys, encode(QuotaState(namespace="race")))
    seen: dict[str, bytes | None] = {}
    revisions: list[int] = []

    async def write() -> None:  # one at a time: `expected` is the bucket after each
        for i in range(60):
            key = f"race.k{(i * 7) % KEYS:03d}"
            value = encode(QuotaState(namespace=f"w{i}"))
            for written in (key, f"race.new{i:02d}"):
                await kv.put(written, value)
                expected[written] = value
            if i % 6 == 0:
                gone = f"race.k{(i * 11 + 1) % KEYS:03d}"
                await kv.delete(gone)
                expected.pop(gone, None)

    proxy.drop(200)
    entries = watch_entries(kv, heartbeat_s=0.5)
    try:
        first = await anext(entries)
        assert first is not None
        writer = asyncio.create_task(write())
        seen[first.key] = first.value
        revisions.append(first.revision)
        async with asyncio.timeout(30):
            while True:
                if writer.done() and {k: v for k, v in seen.items() if v is not None} == expected:
                    await writer
                    break
                entry = await anext(entries)
                if entry is None:
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                seen[entry.key] = None if deleted else entry.value
                revisions.append(entry.revision)
    finally:
        await entries.aclose()
    assert proxy.dropped == 1 and proxy.creates == 2
    assert len(revisions) == len(set(revisions))  # nothing yielded twice
    assert revisions == sorted(revisions)  # in stream order


async def test_a_watch_whose_consumer_vanished_carries_on(proxied) -> None:
    """The consumer is deleted on the server (as a server restart loses it): no heartbeat comes,
    the watch takes a new consumer after two heartbeats' silence, and later values arrive."""
    _proxy, fresh = proxied
    kv = await fresh()
    await kv.put("before", encode(QuotaState(namespace="before")))
    entries = watch_entries(kv, heartbeat_s=0.5)
    js = kv._js  # type: ignore[attr-defined]
    stream = kv._stream  # type: ignore[attr-defined]
    try:
        async with asyncio.timeout(20):
            assert (await anext(entries)).key == "before"  # type: ignore[union-attr]
            assert await anext(entries) is None
            for consumer in await js.consumers_info(stream):
                await js.delete_consumer(stream, consumer.name)
            await kv.put("after", encode(QuotaState(namespace="after")))
            entry = await anext(entries)
    finally:
        await entries.aclose()
    assert entry is not None and entry.key == "after"



async def test_a_watch_of_a_bucket_made_anew_says_so_and_misses_nothing_after(proxied) -> None:
    """NATS lost its store and the bucket was made anew (its sequences start again at 1): the
    watch must not resume after the sequence it had taken from the old one (that would skip
    every value of the new store until it grew past it). It ends with WatchSyncError, and the
    watch taken again, as every consumer of watch_entries does, lists the new store's values."""
    _proxy, fresh = proxied
    kv = await fresh()
    for i in range(6):  # the old store went further than the new one will
        await kv.put("ledger", encode(QuotaState(namespace=f"old-{i}")))
    js = kv._js  # type: ignore[attr-defined]
    name = kv._name  # type: ignore[attr-defined]
    entries = watch_entries(kv, heartbeat_s=0.5)
    try:
        async with asyncio.timeout(30):
            assert (await anext(entries)).revision == 6  # type: ignore[union-attr]
            assert await anext(entries) is None
            await js.delete_key_value(name)
            kv = await js.create_key_value(bucket=name, history=8)
            await kv.put("ledger", encode(QuotaState(namespace="new")))
            with pytest.raises(bus.WatchSyncError, match="made anew"):
                while True:
                    await anext(entries)
    finally:
        await entries.aclose()
    again = watch_entries(kv, heartbeat_s=0.5)
    try:
        async with asyncio.timeout(20):
            entry = await anext(again)
    finally:
        await again.aclose()
    assert entry is not None and entry.revision == 1 and b"new" in (entry.value or b"")

async def test_a_watch_cancelled_as_an_entry_arrives_stops(proxied) -> None:
    """A task consuming a watch stops when cancelled, even when an entry arrives in the same
    turn of the loop: Python 3.11's `asyncio.wait_for` returns the arrival and swallows such a
    cancel, and the watch (with the checker or service loop on top of it) ran on forever."""
    _proxy, fresh = proxied
    kv = await fresh()
    watch = bus._OrderedWatch(kv, ">", False, bus.WATCH_HEARTBEAT_S)
    entries = watch.entries()
    synced = asyncio.Event()

    async def consume() -> None:
        async for entry in entries:
            if entry is None:
                synced.set()

    task = asyncio.create_task(consume())
    try:
        async with asyncio.timeout(20):
            await synced.wait()
        for _ in range(20):  # let it settle into waiting for the next arrival
            await asyncio.sleep(0.01)
        assert not watch.box
        watch.arrived.set()  # an arrival and the cancel in one turn of the loop
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the cancelled watch kept running"
        assert task.cancelled()
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await watch.close()
