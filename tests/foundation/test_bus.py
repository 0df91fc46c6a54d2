"""The bus contract against a real nats-server: CAS, dedupe, TTL, reconnect."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from nats.js import api as js_api

from tessera.bus import (
    EVENTS_STREAM,
    CasConflictError,
    NoChange,
    alloc_event_subject,
    cas_update,
    connect,
    ensure_bus,
    publish_event,
    read,
    subject_token,
    token_name,
    watch_models,
    while_bus_away,
)
from tessera.codec import encode
from tessera.models import AllocationEvent, DeviceInfo, NodeLedger, NodeRegistration, QuotaState
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_ensure_bus_is_idempotent(nc, settings: TesseraSettings) -> None:
    js = nc.jetstream()
    first = await ensure_bus(js, settings)
    again = await asyncio.gather(*(ensure_bus(js, settings) for _ in range(3)))
    assert all(b.ledger._name == first.ledger._name for b in again)
    info = await js.stream_info(EVENTS_STREAM)
    assert info.config.storage == js_api.StorageType.FILE
    assert info.config.duplicate_window >= 60


async def append_items(kv, key: str, tag: str, count: int) -> None:
    """Append tag0..tagN to a shared value, one CAS update each."""
    for i in range(count):

        def add(current: QuotaState | None, i: int = i) -> QuotaState:
            state = current or QuotaState(namespace=key)
            state.source = f"{state.source}{tag}{i},"
            return state

        await cas_update(kv, key, QuotaState, add)


async def test_two_writers_racing_lose_no_update(nc, buckets) -> None:
    """Two clients append to one key at once; every append survives the conflicts."""
    key = unique("ns")
    second = await connect(NatsSettings(NATS_URL=nc.connected_url.geturl()), name="w2")
    try:
        other = await ensure_bus(second.jetstream(), TesseraSettings())
        await asyncio.gather(
            append_items(buckets.quota, key, "a", 30), append_items(other.quota, key, "b", 30)
        )
    finally:
        await second.close()
    final = await read(buckets.quota, key, QuotaState)
    items = [x for x in final.value.source.split(",") if x]
    assert sorted(items) == sorted([f"a{i}" for i in range(30)] + [f"b{i}" for i in range(30)])


async def test_cas_gives_up_after_bounded_attempts_without_writing(buckets) -> None:
    key = unique("node")
    await cas_update(buckets.ledger, key, NodeLedger, lambda _: NodeLedger(node=key))
    interferences = 0

    def mutate(current: NodeLedger | None) -> NodeLedger:
        nonlocal interferences
        interferences += 1
        # Someone else writes between our read and our update, every time.
        asyncio.get_running_loop().create_task(
            buckets.ledger.put(key, encode(NodeLedger(node=f"{key}-other{interferences}")))
        )
        return NodeLedger(node="mine")

    async def racing() -> None:
        await cas_update(buckets.ledger, key, NodeLedger, mutate, attempts=3)

    # Give the interfering puts a chance to land before each update by slowing the writer.
    original_update = buckets.ledger.update

    async def slow_update(*args, **kwargs):
        await asyncio.sleep(0.05)
        return await original_update(*args, **kwargs)

    buckets.ledger.update = slow_update
    try:
        with pytest.raises(CasConflictError):
            await racing()
    finally:
        buckets.ledger.update = original_update
    await asyncio.sleep(0.1)
    assert (await read(buckets.ledger, key, NodeLedger)).value.node != "mine"


async def test_nochange_leaves_the_value_and_revision(buckets) -> None:
    key = unique("node")
    written = await cas_update(buckets.ledger, key, NodeLedger, lambda _: NodeLedger(node=key))

    def keep(_: NodeLedger | None) -> NodeLedger:
        raise NoChange

    kept = await cas_update(buckets.ledger, key, NodeLedger, keep)
    assert kept.revision == written.revision


async def test_republished_event_is_deduplicated(nc, buckets) -> None:
    js = nc.jetstream()
    node = unique("node.with.dots")
    event = AllocationEvent(action="bound", node=node, pod_uid="u1", namespace="ns", name="p")
    before = (await js.stream_info(EVENTS_STREAM)).state.messages
    for _ in range(3):
        await publish_event(js, event)
    await publish_event(js, event.model_copy(update={"event_id": event.event_id + "-2"}))
    after = (await js.stream_info(EVENTS_STREAM)).state.messages
    assert after - before == 2
    msg = await js.get_last_msg(EVENTS_STREAM, alloc_event_subject(node, "bound"))
    assert msg.headers["Nats-Msg-Id"] == event.event_id + "-2"


def test_subject_tokens_escape_reserved_characters() -> None:
    for name in ("gpu-node-1", "node.example.com", "a*b>c", "100%", "sp ace"):
        token = subject_token(name)
        assert not set(token) & set(".*> ")
        assert token_name(token) == name


async def test_registration_expires_with_the_bucket_ttl(fresh_nats: EmbeddedNats) -> None:
    client = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="ttl")
    try:
        buckets = await ensure_bus(client.jetstream(), TesseraSettings(node_ttl_s=1.0))
        registration = NodeRegistration(
            node="n1", devices=[DeviceInfo(uuid="GPU-1", index=0, type="NVIDIA-X", memory_mib=1)]
        )
        put_at = time.monotonic()
        await buckets.nodes.put("n1", encode(registration))
        assert (await read(buckets.nodes, "n1", NodeRegistration)).value == registration
        # The server expires it in the background: wait for that (a busy host can be late)
        # rather than sleep past the TTL and hope, and never earlier than the TTL.
        deadline = put_at + 30
        while await read(buckets.nodes, "n1", NodeRegistration) is not None:
            assert time.monotonic() < deadline, "the registration outlived its 1 s TTL by 29 s"
            await asyncio.sleep(0.05)
        assert time.monotonic() - put_at >= 0.9, "expired before its TTL"
    finally:
        await client.close()


async def test_client_reconnects_after_the_server_restarts(fresh_nats: EmbeddedNats) -> None:
    client = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="restart")
    try:
        buckets = await ensure_bus(client.jetstream(), TesseraSettings())
        await cas_update(buckets.ledger, "n1", NodeLedger, lambda _: NodeLedger(node="n1"))
        fresh_nats.kill()
        await asyncio.sleep(0.5)
        fresh_nats.start()
        for _ in range(100):
            if client.is_connected:
                break
            await asyncio.sleep(0.1)
        assert client.is_connected
        # Data on file storage survived, and CAS writes work again.
        for _ in range(50):
            try:
                current = await read(buckets.ledger, "n1", NodeLedger)
                break
            except Exception:  # JetStream may need a moment to recover its streams
                await asyncio.sleep(0.1)
        assert current is not None and current.value.node == "n1"
        await cas_update(buckets.ledger, "n1", NodeLedger, lambda v: NodeLedger(node="n1-b"))
        assert (await read(buckets.ledger, "n1", NodeLedger)).value.node == "n1-b"
    finally:
        await client.close()


async def test_watch_yields_current_values_then_a_marker_then_changes(buckets) -> None:
    prefix = unique("w")
    # A private bucket keeps this test independent of other tests' keys.
    for i in range(3):
        await buckets.quota.put(f"{prefix}-{i}", encode(QuotaState(namespace=f"{prefix}-{i}")))
    await buckets.quota.put(f"{prefix}-bad", b"garbage")
    errors: list[str] = []
    seen: dict[str, QuotaState | None] = {}
    synced = False
    stream = watch_models(buckets.quota, QuotaState, on_error=lambda k, e: errors.append(k))
    async for key, value, _rev in stream:
        if key == "":
            synced = True
            await buckets.quota.delete(f"{prefix}-0")
            continue
        if key.startswith(prefix):
            seen[key] = value
        if synced and key == f"{prefix}-0":
            break
    await stream.aclose()
    assert seen[f"{prefix}-0"] is None
    assert seen[f"{prefix}-1"] == QuotaState(namespace=f"{prefix}-1")
    assert f"{prefix}-bad" in errors


async def test_bus_keeper_recreates_lost_buckets_and_says_so(fresh_nats: EmbeddedNats) -> None:
    """A deleted bucket (NATS lost it) is re-created by the next check, with the configured
    replicas, and the keeper's generation tells watchers their state is void."""
    from tessera import bus

    settings = TesseraSettings()
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="keeper-test")
    try:
        js = nc.jetstream()
        await ensure_bus(js, settings)
        keeper = bus.BusKeeper(js, settings)
        assert await keeper.check() and keeper.generation == 0
        assert await keeper.check() and keeper.generation == 0  # nothing changed: no bump
        for name in bus.BUS_STREAMS:
            info = await js.stream_info(name)
            assert (info.config.num_replicas or 1) == settings.bus_replicas
        await js.delete_key_value(bus.LEDGER_BUCKET)
        assert await keeper.check()
        assert keeper.generation == 1 and keeper.ready
        await js.stream_info(f"KV_{bus.LEDGER_BUCKET}")  # back
        fresh_nats.stop()
        assert not await keeper.check() and not keeper.ready
        assert "unavailable" in keeper.reason
        fresh_nats.start()
        for _ in range(100):
            if await keeper.check():
                break
            await asyncio.sleep(0.1)
        assert keeper.ready and keeper.generation == 1  # same store: nothing lost, no bump
    finally:
        await nc.close()


async def test_start_up_waits_for_a_restarting_server_instead_of_failing(
    fresh_nats: EmbeddedNats,
) -> None:
    """A service connected just before NATS went away creates its buckets once NATS is back
    (before, `ensure_bus` raised its timeout and the service exited: a node agent restarted
    beside a NATS restart stayed dead, its pods Pending)."""
    client = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="start-up")
    try:
        fresh_nats.kill()
        starting = asyncio.create_task(while_bus_away(
            "ensure the bus", lambda: ensure_bus(client.jetstream(), TesseraSettings())
        ))
        await asyncio.sleep(1.0)
        assert not starting.done()  # waiting, not failed
        fresh_nats.start()
        buckets = await asyncio.wait_for(starting, 60)
        await cas_update(buckets.ledger, "n1", NodeLedger, lambda _: NodeLedger(node="n1"))
        assert (await read(buckets.ledger, "n1", NodeLedger)).value.node == "n1"
    finally:
        await client.close()


async def test_start_up_step_failing_for_another_reason_is_not_retried() -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise PermissionError("nats: permissions violation")

    with pytest.raises(PermissionError):
        await while_bus_away("refused step", refused)
    assert calls == 1
