"""Issue 13's forgeries, each attempted with the wrong identity against a real nats-server
running the generated authorization block: NATS itself refuses them (a permissions violation),
nothing is written, and the rightful identity can still do the same thing."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client
from nats.js import api as js_api

from tessera import bus
from tessera import bus_permissions as bp
from tessera.bus import connect, ensure_bus, publish_event
from tessera.codec import encode
from tessera.events import decode_event, subscribe
from tessera.models import (
    AllocationEvent,
    ComputeReclaimEvent,
    Event,
    NodeLedger,
    NodeRegistration,
    QuotaState,
)
from tessera.settings import TesseraSettings

NODE_A, NODE_B = "node-a", "node-b"


class Client_:
    """A connection as one identity that records the errors NATS sends back to it."""

    def __init__(self, nc: Client, errors: list[Exception]) -> None:
        self.nc = nc
        self.errors = errors

    async def violation(self, fragment: str, timeout_s: float = 5.0) -> str:
        """Wait for NATS's permissions violation about `fragment`; its text."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            for err in self.errors:
                text = str(err)
                if "permissions violation" in text.lower() and fragment.lower() in text.lower():
                    return text
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {fragment!r}; got {self.errors}")


@pytest.fixture
async def as_identity(auth_nats) -> AsyncIterator[Callable[..., Awaitable[Client_]]]:
    opened: list[Client] = []

    async def open_(role: str, node: str | None = None) -> Client_:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        settings = auth_nats.settings(role, node)
        nc = await nats.connect(
            auth_nats.url, user=settings.user, password=settings.password, name=f"t-{role}",
            inbox_prefix=bus.inbox_prefix(settings.user or ""), error_cb=on_error,
            allow_reconnect=False,
        )
        opened.append(nc)
        return Client_(nc, errors)

    yield open_
    for nc in opened:
        await nc.close()


@pytest.fixture
async def admin(as_identity) -> Client_:
    client = await as_identity(bp.ADMIN)
    await ensure_bus(client.nc.jetstream(), TesseraSettings())
    return client


async def kv_value(admin: Client_, bucket: str, key: str) -> bytes | None:
    kv = await admin.nc.jetstream().key_value(bucket)
    try:
        entry = await kv.get(key)
    except Exception:
        return None
    return entry.value


# A refused publish never gets an ack: the server's permissions violation naming its subject is
# the proof (and an accepted one that answers later than this still fails on the violation).
REFUSED_ACK_WAIT_S = 0.25


async def forged_put(client: Client_, bucket: str, key: str, value: bytes) -> None:
    """A KV put the server must refuse: no ack comes back, only the violation."""
    # What KeyValue.put does, with a short wait for the ack that never comes.
    with pytest.raises(Exception):  # noqa: B017 - a timeout
        await client.nc.jetstream().publish(bp.kv_subject(bucket, key), value,
                                            timeout=REFUSED_ACK_WAIT_S)  # fmt: skip
    await client.violation(bp.kv_subject(bucket, key))


async def forged_event(client: Client_, event: Event) -> None:
    """An event publish (the services' own publish_event) the server must refuse: no ack within
    REFUSED_ACK_WAIT_S (publish_event would wait 2 s for it), and the violation."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(publish_event(client.nc.jetstream(), event, attempts=1),
                               REFUSED_ACK_WAIT_S)  # fmt: skip
    await client.violation(bus.event_subject(event))


# --- who may connect at all ----------------------------------------------------------------------


async def test_an_anonymous_client_is_refused(auth_nats) -> None:
    with pytest.raises(Exception) as refused:
        await nats.connect(auth_nats.url, allow_reconnect=False, max_reconnect_attempts=0)
    assert "authorization" in str(refused.value).lower()


async def test_a_wrong_password_is_refused(auth_nats) -> None:
    user = bp.user_name(bp.SCHEDULER)
    with pytest.raises(Exception) as refused:
        await nats.connect(
            auth_nats.url, user=user, password="guess", allow_reconnect=False,
            max_reconnect_attempts=0,
        )
    assert "authorization" in str(refused.value).lower()


# --- node agents: only their own node ---------------------------------------------------------


async def test_node_agent_cannot_register_another_node(as_identity, admin) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    kv = await agent_a.nc.jetstream().key_value(bus.NODES_BUCKET)
    own = NodeRegistration(node=NODE_A, devices=[])
    await kv.put(NODE_A, encode(own))  # its own registration: accepted
    before = await kv_value(admin, bus.NODES_BUCKET, NODE_B)

    forged = NodeRegistration(node=NODE_B, devices=[])
    await forged_put(agent_a, bus.NODES_BUCKET, NODE_B, encode(forged))
    assert await kv_value(admin, bus.NODES_BUCKET, NODE_B) == before
    assert await kv_value(admin, bus.NODES_BUCKET, NODE_A) == encode(own)


async def test_node_agent_cannot_write_another_nodes_ledger(as_identity, admin) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    kv = await agent_a.nc.jetstream().key_value(bus.LEDGER_BUCKET)
    await kv.put(NODE_A, encode(NodeLedger(node=NODE_A)))  # its own node's state: accepted
    before = await kv_value(admin, bus.LEDGER_BUCKET, NODE_B)

    await forged_put(agent_a, bus.LEDGER_BUCKET, NODE_B, b"garbage")
    assert await kv_value(admin, bus.LEDGER_BUCKET, NODE_B) == before


async def test_node_names_are_literal_keys(as_identity, admin) -> None:
    """'gpu.node-c' is several subject tokens: node-a's key must not be a prefix of it."""
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    await forged_put(agent_a, bus.NODES_BUCKET, f"{NODE_A}.x", b"x")
    agent_c = await as_identity(bp.NODE_AGENT, "gpu.node-c")
    kv = await agent_c.nc.jetstream().key_value(bus.NODES_BUCKET)
    await kv.put("gpu.node-c", encode(NodeRegistration(node="gpu.node-c", devices=[])))
    await forged_put(agent_c, bus.NODES_BUCKET, "gpu", b"x")


async def test_node_agent_cannot_set_limits_on_another_node(as_identity) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    agent_b = await as_identity(bp.NODE_AGENT, NODE_B)
    received: list[str] = []

    async def on_request(msg) -> None:
        received.append(msg.subject)
        await msg.respond(b"ok")

    await agent_b.nc.subscribe(bus.node_limits_subject(NODE_B), cb=on_request)
    await bus.flush(agent_b.nc)
    await agent_a.nc.publish(bus.node_limits_subject(NODE_B), b"raise my neighbour")
    await bus.flush(agent_a.nc)
    await agent_a.violation(bus.node_limits_subject(NODE_B))

    admin_cli = await as_identity(bp.ADMIN)  # the CLI's admin role may
    reply = await admin_cli.nc.request(bus.node_limits_subject(NODE_B), b"x", timeout=5)
    assert reply.data == b"ok"
    assert received == [bus.node_limits_subject(NODE_B)]


async def test_node_agent_cannot_serve_another_nodes_limits(as_identity) -> None:
    """Nor hijack them: subscribing to node B's endpoint is refused too."""
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    await agent_a.nc.subscribe(bus.node_limits_subject(NODE_B), queue="q")
    await bus.flush(agent_a.nc)
    await agent_a.violation(bus.node_limits_subject(NODE_B))


async def test_node_agent_cannot_publish_other_nodes_or_release_events(as_identity) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    mine = AllocationEvent(action="allocated", node=NODE_A, pod_uid="u", namespace="n", name="p")
    await publish_event(agent_a.nc.jetstream(), mine)  # its own allocation: accepted
    for forged in (
        AllocationEvent(action="allocated", node=NODE_B, pod_uid="u", namespace="n", name="p"),
        AllocationEvent(action="released", node=NODE_A, pod_uid="u", namespace="n", name="p"),
    ):
        await forged_event(agent_a, forged)


async def test_only_a_node_agent_reports_compute_reclaimed_on_its_own_node(as_identity) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    scheduler = await as_identity(bp.SCHEDULER)

    def reclaimed(node: str) -> ComputeReclaimEvent:
        return ComputeReclaimEvent(node=node, device_uuid="GPU-1", pod_uid="u", namespace="n",
                                   pod="p", reclaims=3, max_taken_pct=40)  # fmt: skip

    await publish_event(agent_a.nc.jetstream(), reclaimed(NODE_A))  # its own node: accepted
    for client, forged in ((agent_a, reclaimed(NODE_B)), (scheduler, reclaimed(NODE_A))):
        await forged_event(client, forged)


async def test_replies_are_private_to_each_identity(as_identity) -> None:
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    await agent_a.nc.subscribe("_INBOX.>")
    await bus.flush(agent_a.nc)
    await agent_a.violation("_INBOX.>")


# --- quota: only the quota service writes it, only the admin sets limits ------------------------


@pytest.mark.parametrize(
    "role,node",
    [(bp.SCHEDULER, None), (bp.ADMISSION, None), (bp.METRICS, None), (bp.EVENTS_READER, None),
     (bp.NODE_AGENT, NODE_A)],
)
async def test_only_the_admin_may_set_quota(as_identity, role: str, node: str | None) -> None:
    quota = await as_identity(bp.QUOTA)  # stands in for the quota service's endpoint
    received: list[bytes] = []

    async def on_set(msg) -> None:
        received.append(msg.data)
        await msg.respond(b"done")

    await quota.nc.subscribe(bus.QUOTA_SET, queue="q", cb=on_set)
    await bus.flush(quota.nc)

    client = await as_identity(role, node)
    await client.nc.publish(bus.QUOTA_SET, b"lift victim's quota")
    await bus.flush(client.nc)
    await client.violation(bus.QUOTA_SET)

    admin_cli = await as_identity(bp.ADMIN)
    reply = await admin_cli.nc.request(bus.QUOTA_SET, b"admin", timeout=5)
    assert reply.data == b"done"
    assert received == [b"admin"]


@pytest.mark.parametrize(
    "role,node",
    [(bp.SCHEDULER, None), (bp.ADMISSION, None), (bp.METRICS, None), (bp.ADMIN, None),
     (bp.NODE_AGENT, NODE_A)],
)
async def test_only_quota_writes_the_quota_bucket(
    as_identity, admin, role: str, node: str | None
) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    quota = await as_identity(bp.QUOTA)
    kv = await quota.nc.jetstream().key_value(bus.QUOTA_BUCKET)
    real = encode(QuotaState(namespace=namespace))
    await kv.put(namespace, real)  # the quota service: accepted

    client = await as_identity(role, node)
    await forged_put(client, bus.QUOTA_BUCKET, namespace, b"lifted")
    assert await kv_value(admin, bus.QUOTA_BUCKET, namespace) == real


# --- the ledger: the scheduler (and node agents for their node) only --------------------------


@pytest.mark.parametrize(
    "role,node",
    [(bp.ADMISSION, None), (bp.QUOTA, None), (bp.METRICS, None), (bp.ADMIN, None),
     (bp.NODE_AGENT, NODE_B)],
)
async def test_only_the_scheduler_writes_any_ledger_key(
    as_identity, admin, role: str, node: str | None
) -> None:
    scheduler = await as_identity(bp.SCHEDULER)
    kv = await scheduler.nc.jetstream().key_value(bus.LEDGER_BUCKET)
    real = encode(NodeLedger(node=NODE_A))
    await kv.put(NODE_A, real)  # the scheduler: accepted

    client = await as_identity(role, node)
    await forged_put(client, bus.LEDGER_BUCKET, NODE_A, b"garbage")
    assert await kv_value(admin, bus.LEDGER_BUCKET, NODE_A) == real


# --- event consumers are read-only ------------------------------------------------------------


async def test_event_subscriber_reads_but_cannot_forge_a_release(as_identity) -> None:
    scheduler = await as_identity(bp.SCHEDULER)
    reader = await as_identity(bp.EVENTS_READER)
    node = f"n-{uuid.uuid4().hex[:6]}"
    real = AllocationEvent(action="bound", node=node, pod_uid="u1", namespace="n", name="p")
    await publish_event(scheduler.nc.jetstream(), real)

    stream = subscribe(reader.nc, bus.alloc_event_subject(node, "*").replace("%2A", "*"))
    received = await asyncio.wait_for(anext(stream), 10)
    assert received.event.event_id == real.event_id
    await stream.aclose()

    forged = AllocationEvent(action="released", node=node, pod_uid="u1", namespace="n", name="p")
    await forged_event(reader, forged)


async def test_event_subscriber_cannot_take_over_the_quota_services_consumer(
    as_identity, admin
) -> None:
    quota = await as_identity(bp.QUOTA)  # the quota service's own durable: allowed
    quota_sub = await quota.nc.jetstream().pull_subscribe(
        bus.alloc_events_filter("released"), durable=bus.QUOTA_RELEASED_CONSUMER,
        stream=bus.EVENTS_STREAM,
    )
    scheduler = await as_identity(bp.SCHEDULER)
    released = AllocationEvent(action="released", node=f"n-{uuid.uuid4().hex[:6]}",
                               pod_uid="u2", namespace="n", name="p")
    await publish_event(scheduler.nc.jetstream(), released)

    reader = await as_identity(bp.EVENTS_READER)
    js = reader.nc.jetstream()
    # Its own durable is fine ...
    mine = await js.pull_subscribe(bus.EVENTS_ALL, durable=f"billing-{uuid.uuid4().hex[:6]}",
                                   stream=bus.EVENTS_STREAM)
    assert len(await mine.fetch(1, timeout=5)) == 1
    await mine.unsubscribe()
    # ... pulling (and so acknowledging away) the quota service's releases is not ...
    stolen = await js.pull_subscribe(bus.alloc_events_filter("released"),
                                     durable=bus.QUOTA_RELEASED_CONSUMER,
                                     stream=bus.EVENTS_STREAM)
    with pytest.raises(Exception):  # noqa: B017 - a timeout: the pull request never got through
        await stolen.fetch(1, timeout=REFUSED_ACK_WAIT_S)
    await reader.violation(f"CONSUMER.MSG.NEXT.{bus.EVENTS_STREAM}.{bus.QUOTA_RELEASED_CONSUMER}")
    got = await quota_sub.fetch(10, timeout=5)
    assert released.event_id in [decode_event(m.data).event_id for m in got]
    # ... nor re-creating it with another filter (by name in the subject) ...
    config = js_api.ConsumerConfig(name=bus.QUOTA_RELEASED_CONSUMER,
                                   durable_name=bus.QUOTA_RELEASED_CONSUMER,
                                   filter_subject="tessera.events.nothing")
    with pytest.raises(Exception):  # noqa: B017 - a timeout
        await js.add_consumer(bus.EVENTS_STREAM, config, timeout=REFUSED_ACK_WAIT_S)
    await reader.violation(f"CONSUMER.CREATE.{bus.EVENTS_STREAM}.{bus.QUOTA_RELEASED_CONSUMER}")
    # ... nor through the unnamed create subject with the name in the body: the server
    # refuses a durable there.
    config = js_api.ConsumerConfig(durable_name=bus.QUOTA_RELEASED_CONSUMER,
                                   filter_subject=bus.EVENTS_ALL)
    body = {"stream_name": bus.EVENTS_STREAM, "config": config.as_dict()}
    reply = await reader.nc.request(
        f"$JS.API.CONSUMER.CREATE.{bus.EVENTS_STREAM}", json.dumps(body).encode(), timeout=5
    )
    assert "error" in json.loads(reply.data), reply.data
    info = await admin.nc.jetstream().consumer_info(bus.EVENTS_STREAM,
                                                    bus.QUOTA_RELEASED_CONSUMER)
    assert info.config.filter_subject == bus.alloc_events_filter("released")


# --- each identity can still do its job --------------------------------------------------------


@pytest.mark.parametrize(
    "role,node",
    [(bp.SCHEDULER, None), (bp.QUOTA, None), (bp.ADMISSION, None), (bp.METRICS, None),
     (bp.NODE_AGENT, NODE_A), (bp.ADMIN, None)],
)
async def test_every_service_identity_sets_up_the_bus(auth_nats, role: str, node) -> None:
    """tessera.service.serve's first steps (connect with its own inbox, ensure_bus) work."""
    nc = await connect(auth_nats.settings(role, node), name=f"t-{role}", initial_attempts=1)
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        assert buckets.ledger is not None
    finally:
        await nc.close()
