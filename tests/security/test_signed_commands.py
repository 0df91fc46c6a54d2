"""Issue 34: commands prove who sent them. Against a real nats-server running the generated
permissions with every service's own identity, a real quota service and a real node agent (of
node-b): each identity tries, against every state-changing endpoint,

- the relay: a captured valid command stored in a stream through something it (or, for
  identities that cannot both write and read a stream, one partner) may write, then a push
  consumer whose deliver subject is the endpoint;
- the replay: the captured command resent as it was.

Nothing changes, and each attempt is reported: by nats-server (a permissions violation) or by the
receiver (a `rejected.command` refusal naming the claimed sender)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import api as js_api

from tessera import bus, signing
from tessera import bus_permissions as bp
from tessera.bus import connect, ensure_bus
from tessera.codec import decode, encode
from tessera.dra_names import DRA_REASON
from tessera.models import (
    Allocation,
    AllocationState,
    LimitsSetReply,
    LimitsSetRequest,
    NodeConfigSetRequest,
    NodeConfigStatus,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
    RemoteError,
    decode_reply,
)
from tessera.settings import TesseraSettings

sys.path.insert(0, str(Path(__file__).parents[1] / "node_agent"))
from node_agent_rig import grants, running_rig
from tessera.quota.service import QuotaService

VICTIM_NODE = "node-b"
IDENTITIES = [
    (bp.ADMISSION, None), (bp.SCHEDULER, None), (bp.QUOTA, None), (bp.METRICS, None),
    (bp.EVENTS_READER, None), (bp.NODE_AGENT, "node-a"), (bp.NODE_AGENT, VICTIM_NODE),
    (bp.ADMIN, None),
]  # fmt: skip
ENDPOINTS = ("quota.set", "quota.reserve", "quota.release", "limits.set", "config.set")


@dataclass
class Captured:
    """A valid signed command as it crossed the bus."""

    subject: str
    payload: bytes
    headers: dict[str, str]


@dataclass
class World:
    auth: object
    keys_dir: Path
    quota: QuotaService
    rig: object
    namespace: str
    pod: dict
    uid: str
    gpu: str
    clients: dict[str, Client] = field(default_factory=dict)
    errors: dict[str, list[Exception]] = field(default_factory=dict)

    def signer(self, role: str, node: str | None = None) -> signing.Signer:
        user = bp.user_name(role, node)
        return signing.signer_from_files(user, str(self.keys_dir / f"{user}.pem"))

    async def client(self, role: str, node: str | None = None) -> Client:
        user = bp.user_name(role, node)
        if user not in self.clients:
            errors: list[Exception] = []

            async def on_error(exc: Exception) -> None:
                errors.append(exc)

            settings = self.auth.settings(role, node)  # type: ignore[attr-defined]
            self.clients[user] = await nats.connect(
                settings.url, user=settings.user, password=settings.password,
                inbox_prefix=bus.inbox_prefix(user), error_cb=on_error, allow_reconnect=False,
                name=f"t-{user}",
            )  # fmt: skip
            self.errors[user] = errors
        return self.clients[user]

    async def send(self, role: str, subject: str, body: object,
                   node: str | None = None) -> tuple[Captured, bytes]:  # fmt: skip
        """A legitimate, signed command; what crossed the bus and the reply."""
        payload = encode(body)  # type: ignore[arg-type]
        headers = self.signer(role, node).headers(subject, payload)
        nc = await self.client(role, node)
        reply = await nc.request(subject, payload, timeout=10, headers=headers)
        return Captured(subject, payload, headers), reply.data

    # --- what the endpoints change --------------------------------------------------------

    async def observe(self) -> tuple[object, ...]:
        admin = await self.client(bp.ADMIN)
        status = decode((await admin.request(
            bus.QUOTA_STATUS, encode(QuotaStatusRequest(namespace=self.namespace)), timeout=10,
        )).data, QuotaReply)  # fmt: skip
        state = status.states[0]
        charge = state.charges.get(self.uid)
        ledger = await self.rig.ledger()  # type: ignore[attr-defined]
        grant = ledger.allocations[self.uid].containers[0][0]
        config = decode((await admin.request(
            bus.node_config_get_subject(VICTIM_NODE), b"{}", timeout=10)).data, NodeConfigStatus)
        return (state.limits.memory_mib, charge.memory_mib if charge else None,
                grant.memory_mib, dict(config.local))  # fmt: skip

    def gates(self) -> list:
        agent = self.rig.agent  # type: ignore[attr-defined]
        return [self.quota.commands, agent.limits.commands, agent.configurator.commands]

    def mark(self) -> list[int]:
        """How many refusals each receiver has reported so far (their lists stay short)."""
        return [len(g.recent) for g in self.gates()]

    def refusals(self, since: list[int] | None = None) -> list[tuple[str, str, str]]:
        since = since or [0] * len(self.gates())
        return [r for g, n in zip(self.gates(), since, strict=True) for r in list(g.recent)[n:]]


def write_keys(auth: object, directory: Path) -> None:
    for user, key in auth.keys.items():  # type: ignore[attr-defined]
        (directory / f"{user}.pem").write_bytes(signing.private_pem(key))
    (directory / "trust.json").write_text(signing.trust_text(auth.keys))  # type: ignore[attr-defined]


@pytest.fixture
async def world(auth_nats) -> AsyncIterator[World]:
    base = Path(tempfile.mkdtemp(prefix="tss-"))
    keys_dir = base / "keys"
    keys_dir.mkdir()
    write_keys(auth_nats.auth, keys_dir)
    trust = str(keys_dir / "trust.json")
    agent_user = bp.user_name(bp.NODE_AGENT, VICTIM_NODE)
    quota_user = bp.user_name(bp.QUOTA)
    agent_nc = await connect(auth_nats.settings(bp.NODE_AGENT, VICTIM_NODE), "t-agent-b")
    quota_nc = await connect(auth_nats.settings(bp.QUOTA), "t-quota")
    quota_settings = TesseraSettings(command_trust_file=trust,
                                     command_key_file=str(keys_dir / f"{quota_user}.pem"))
    buckets = await ensure_bus(agent_nc.jetstream(), quota_settings)
    # The session's server is shared: node-b starts each test with nothing allocated.
    await buckets.ledger.put(VICTIM_NODE, encode(NodeLedger(node=VICTIM_NODE)))
    namespace = f"sig-{uuid.uuid4().hex[:8]}"
    uid = f"uid-{namespace}"
    pod = {
        "metadata": {"name": "victim", "namespace": namespace, "uid": uid},
        "spec": {"nodeName": VICTIM_NODE, "containers": [{"name": "main", "resources": {
            "limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 6000,
                       "nvidia.com/gpucores": 30}}}]},
    }  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        rig = await stack.enter_async_context(running_rig(
            base / "r", agent_nc, buckets, node=VICTIM_NODE, command_trust_file=trust,
            command_key_file=str(keys_dir / f"{agent_user}.pem"),
        ))  # fmt: skip
        quota = QuotaService(quota_nc, await ensure_bus(quota_nc.jetstream(), quota_settings),
                             quota_settings, cluster=rig.cluster)  # fmt: skip
        await quota.start()
        stack.push_async_callback(quota.stop)
        gpu = rig.gpus[0]
        await rig.bind(pod, [grants((gpu, 2000, 30))])
        admitted = await rig.kubelet.admit_pod(pod)
        assert admitted.ok, admitted.error
        w = World(auth_nats, keys_dir, quota, rig, namespace, pod, uid, gpu)
        try:
            _, raw = await w.send(bp.ADMIN, bus.QUOTA_SET, QuotaSetRequest(
                namespace=namespace, limits=QuotaAmount(memory_mib=20000)))
            assert decode(raw, QuotaReply).ok
            yield w
        finally:
            for client in w.clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
    for client in (agent_nc, quota_nc):
        with contextlib.suppress(Exception):
            await client.close()
    shutil.rmtree(base, ignore_errors=True)


# --- the endpoints: a first command (captured), a second that changes the state again ---------

Step = Callable[[World], Awaitable[Captured]]


def _reserve(w: World, memory: int = 2000) -> QuotaRequest:
    return QuotaRequest(namespace=w.namespace, pod_uid=w.uid, name="victim", memory_mib=memory,
                        cores=30, gpus=1)  # fmt: skip


async def _ok(w: World, role: str, subject: str, body: object, model: type,
              node: str | None = None) -> Captured:  # fmt: skip
    captured, raw = await w.send(role, subject, body, node)
    reply = decode(raw, model)
    assert reply.ok, f"{subject} by {role}: {reply.reason}"
    return captured


async def quota_set(w: World) -> Captured:
    first = await _ok(w, bp.ADMIN, bus.QUOTA_SET, QuotaSetRequest(
        namespace=w.namespace, limits=QuotaAmount(memory_mib=5000)), QuotaReply)
    await _ok(w, bp.ADMIN, bus.QUOTA_SET, QuotaSetRequest(
        namespace=w.namespace, limits=QuotaAmount(memory_mib=7000)), QuotaReply)
    return first


async def quota_reserve(w: World) -> Captured:
    first = await _ok(w, bp.SCHEDULER, bus.QUOTA_RESERVE, _reserve(w), QuotaReply)
    await _ok(w, bp.SCHEDULER, bus.QUOTA_RELEASE, QuotaRequest(
        namespace=w.namespace, pod_uid=w.uid, name="victim"), QuotaReply)
    return first


async def quota_release(w: World) -> Captured:
    await _ok(w, bp.SCHEDULER, bus.QUOTA_RESERVE, _reserve(w), QuotaReply)
    first = await _ok(w, bp.SCHEDULER, bus.QUOTA_RELEASE, QuotaRequest(
        namespace=w.namespace, pod_uid=w.uid, name="victim"), QuotaReply)
    await _ok(w, bp.SCHEDULER, bus.QUOTA_RESERVE, _reserve(w, 2500), QuotaReply)
    return first


async def limits_set(w: World) -> Captured:
    target = {"namespace": w.namespace, "pod": "victim", "container": "main"}
    subject = bus.node_limits_subject(VICTIM_NODE)
    first = await _ok(w, bp.ADMIN, subject, LimitsSetRequest(memory_mib=5000, **target),
                      LimitsSetReply)  # fmt: skip
    await _ok(w, bp.ADMIN, subject, LimitsSetRequest(memory_mib=3000, **target), LimitsSetReply)
    return first


async def config_set(w: World) -> Captured:
    subject = bus.node_config_set_subject(VICTIM_NODE)
    first = await _ok(w, bp.ADMIN, subject, NodeConfigSetRequest(
        config={"devicesplitcount": 6}), NodeConfigStatus)
    await _ok(w, bp.ADMIN, subject, NodeConfigSetRequest(reset=True), NodeConfigStatus)
    return first


STEPS: dict[str, Step] = {
    "quota.set": quota_set, "quota.reserve": quota_reserve, "quota.release": quota_release,
    "limits.set": limits_set, "config.set": config_set,
}


# --- the attacks -------------------------------------------------------------------------------


async def replay(w: World, role: str, node: str | None, captured: Captured) -> str:
    """Resend the captured command as `role`; how it was refused: by the receiver (its reply) or
    by nats-server (a permissions violation for the subject, reported to this client since it
    sent). A publish nats-server refused reaches no one, so no reply can follow: the violation
    answers at once instead of the request's timeout."""
    nc = await w.client(role, node)
    user = bp.user_name(role, node)
    seen = len(w.errors[user])
    request = asyncio.ensure_future(nc.request(
        captured.subject, captured.payload, timeout=10, headers=dict(captured.headers)))
    reported = asyncio.ensure_future(violation(w, user, captured.subject, seen))
    try:
        await asyncio.wait({request, reported}, return_when=asyncio.FIRST_COMPLETED)
        if reported.done():
            return reported.result()
        try:
            msg = request.result()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return await reported
    finally:
        for task in (request, reported):
            task.cancel()
        await asyncio.gather(request, reported, return_exceptions=True)
    text = msg.data.decode(errors="replace")
    assert "command refused (replayed)" in text or "command refused" in text, text
    return text


async def violation(w: World, user: str, fragment: str, seen: int = 0) -> str:
    """nats-server's permissions violation for `fragment`, among the errors reported to
    `user`'s client after the first `seen`."""
    deadline = asyncio.get_running_loop().time() + 12
    while asyncio.get_running_loop().time() < deadline:
        for err in w.errors[user][seen:]:
            if "permissions violation" in str(err).lower() and fragment in str(err):
                return str(err)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{user}: neither refused by the service nor by NATS: {w.errors[user]}")


def _key() -> str:
    return f"relay-{uuid.uuid4().hex[:8]}"


async def relay(w: World, role: str, node: str | None, captured: Captured) -> None:
    """Store the captured command (headers and all) through a write this identity (or a partner
    with the complementary right) has, and have a push consumer deliver it to the endpoint."""
    if role == bp.QUOTA:  # writes and watches its bucket: alone
        writer, reader = (role, None), (role, None)
        stream, subject = bp.kv_stream(bus.QUOTA_BUCKET), f"$KV.{bus.QUOTA_BUCKET}.{_key()}"
    elif role == bp.SCHEDULER:  # writes and watches the ledger: alone
        writer, reader = (role, None), (role, None)
        stream, subject = bp.kv_stream(bus.LEDGER_BUCKET), f"$KV.{bus.LEDGER_BUCKET}.{_key()}"
    elif role in (bp.METRICS, bp.EVENTS_READER, bp.ADMIN):  # readers: node-a writes an event
        writer, reader = (bp.NODE_AGENT, "node-a"), (role, None)
        stream, subject = bus.EVENTS_STREAM, bus.node_event_subject("node-a", "registered")
    elif role == bp.ADMISSION:  # writes its events; the events reader reads them
        writer, reader = (role, None), (bp.EVENTS_READER, None)
        stream, subject = bus.EVENTS_STREAM, bus.admission_event_subject(w.namespace, "allowed")
    else:  # a node agent: its own node's events
        writer, reader = (role, node), (bp.EVENTS_READER, None)
        stream, subject = bus.EVENTS_STREAM, bus.node_event_subject(node or "", "registered")
    write_nc = await w.client(*writer)
    headers = {**captured.headers, "Nats-Msg-Id": uuid.uuid4().hex}
    ack = await write_nc.jetstream().publish(subject, captured.payload, headers=headers,
                                             timeout=5)  # fmt: skip
    read_nc = await w.client(*reader)
    await read_nc.jetstream().add_consumer(stream, js_api.ConsumerConfig(
        deliver_subject=captured.subject, deliver_group="q", filter_subject=subject,
        deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=ack.seq,
        ack_policy=js_api.AckPolicy.NONE,
        inactive_threshold=5.0,
    ))  # fmt: skip


async def wait_for_refusal(w: World, code: str, before: list[int],
                           sender: str) -> tuple[str, str, str]:  # fmt: skip
    """The receiver's report of a refusal of the relayed command (a relay subject may also
    carry real events, and earlier relays' consumers live a few seconds)."""
    deadline = asyncio.get_running_loop().time() + 15
    while asyncio.get_running_loop().time() < deadline:
        found = [r for r in w.refusals(before) if r[1] == code and r[2] == sender]
        if found:
            return found[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {code} refusal reported; got {w.refusals(before)}")


@pytest.mark.parametrize(("role", "node"), IDENTITIES,
                         ids=[bp.user_name(r, n) for r, n in IDENTITIES])  # fmt: skip
async def test_relay_and_replay_change_nothing_and_are_reported(world, role, node) -> None:
    w = world
    for endpoint in ENDPOINTS:
        captured = await STEPS[endpoint](w)
        settled = await w.observe()

        await replay(w, role, node, captured)
        assert await w.observe() == settled, f"{endpoint}: a replay by {role} changed state"

        before = w.mark()
        await relay(w, role, node, captured)
        await wait_for_refusal(w, "jetstream_delivery", before, captured.headers[signing.SENDER])
        assert await w.observe() == settled, f"{endpoint}: a relay by {role} changed state"


# --- a namespace cannot be locked out (issue 34, finding 3) ----------------------------------


def refusal_of(raw: bytes) -> str:
    try:
        reply = decode_reply(raw, QuotaReply)
    except RemoteError as error:
        return error.reason
    return f"not refused: {reply.reason}"


async def test_no_credential_but_the_schedulers_holds_quota_for_a_made_up_pod(world) -> None:
    w = world
    await _ok(w, bp.ADMIN, bus.QUOTA_SET, QuotaSetRequest(
        namespace=w.namespace, limits=QuotaAmount(memory_mib=8000)), QuotaReply)
    phantom = QuotaRequest(namespace=w.namespace, pod_uid=str(uuid.uuid4()), name="phantom",
                           memory_mib=8000, cores=0, gpus=1)  # fmt: skip
    elsewhere = _reserve(w, 8000)  # the real pod, bound to node-b
    attempts = [
        (bp.NODE_AGENT, "node-a", phantom, "does not exist"),
        (bp.NODE_AGENT, "node-a", elsewhere, "not on node-a"),
        (bp.NODE_AGENT, VICTIM_NODE, phantom, "does not exist"),
        (bp.ADMISSION, None, phantom, "may not hold quota"),
        (bp.SCHEDULER, None, phantom, "does not exist"),
    ]
    for role, node, body, why in attempts:
        before = w.mark()
        _, raw = await w.send(role, bus.QUOTA_RESERVE, body, node)
        assert why in refusal_of(raw), (role, node, refusal_of(raw))
        sender = bp.user_name(role, node)
        await wait_for_refusal(w, "not_allowed", before, sender)
    # Unsigned, in the scheduler's name: refused too.
    nc = await w.client(bp.SCHEDULER)
    raw = (await nc.request(bus.QUOTA_RESERVE, encode(phantom), timeout=10)).data
    assert "command refused (unsigned)" in refusal_of(raw)
    status = decode((await (await w.client(bp.ADMIN)).request(
        bus.QUOTA_STATUS, encode(QuotaStatusRequest(namespace=w.namespace)), timeout=10,
    )).data, QuotaReply)  # fmt: skip
    assert status.states[0].charges == {}
    # Admission may still ask; the real pod still gets its quota (from its own node's agent too).
    check = phantom.model_copy(update={"check_only": True})
    assert decode((await w.send(bp.ADMISSION, bus.QUOTA_RESERVE, check))[1], QuotaReply).ok
    await _ok(w, bp.NODE_AGENT, bus.QUOTA_RESERVE, _reserve(w, 6000), QuotaReply, VICTIM_NODE)
    await _ok(w, bp.SCHEDULER, bus.QUOTA_RESERVE, _reserve(w, 6000), QuotaReply)


async def test_only_the_node_agent_holding_a_dra_booking_hands_its_charge_on(world) -> None:
    """`handed_from` frees a charge: only the agent of the node where that pod has its DRA
    booking (a shared claim's first pod) may send it. Another node's agent, the scheduler, or a
    hand-on from an extender pod is refused; nothing is freed."""
    w = world
    first_uid = f"first-{w.namespace}"
    booked = Allocation(pod_uid=first_uid, namespace=w.namespace, name="shared-first",
                        node=VICTIM_NODE, reason=DRA_REASON, state=AllocationState.ALLOCATED,
                        containers=[grants((w.gpu, 2000, 30))])  # fmt: skip
    ledger = await w.rig.ledger()  # type: ignore[attr-defined]
    ledger.allocations[first_uid] = booked
    await w.rig.buckets.ledger.put(VICTIM_NODE, encode(ledger))  # type: ignore[attr-defined]
    nxt, there = (copy.deepcopy(w.pod) for _ in range(2))
    nxt["metadata"].update(name="shared-next", uid=f"next-{w.namespace}")
    there["metadata"].update(name="on-a", uid=f"on-a-{w.namespace}")
    there["spec"]["nodeName"] = "node-a"
    w.rig.cluster.add_pod(nxt)  # type: ignore[attr-defined]
    w.rig.cluster.add_pod(there)  # type: ignore[attr-defined]
    first = QuotaRequest(namespace=w.namespace, pod_uid=first_uid, name="shared-first",
                         memory_mib=2000, cores=30, gpus=1)  # fmt: skip
    assert (await w.quota.reserve(first)).ok  # (its pod is gone: charged when it was there)
    await _ok(w, bp.SCHEDULER, bus.QUOTA_RESERVE, _reserve(w), QuotaReply)

    def hand_on(pod: dict, source: str) -> QuotaRequest:
        return QuotaRequest(namespace=w.namespace, pod_uid=pod["metadata"]["uid"],
                            name=pod["metadata"]["name"], memory_mib=2000, cores=30, gpus=1,
                            handed_from=source)  # fmt: skip

    attempts = [
        (bp.NODE_AGENT, "node-a", hand_on(there, first_uid), "no DRA booking"),
        (bp.SCHEDULER, None, hand_on(nxt, first_uid), "may not hand quota charges on"),
        (bp.NODE_AGENT, VICTIM_NODE, hand_on(nxt, w.uid), "no DRA booking"),  # extender pod
    ]
    for role, node, body, why in attempts:
        before = w.mark()
        _, raw = await w.send(role, bus.QUOTA_RESERVE, body, node)
        assert why in refusal_of(raw), (role, node, refusal_of(raw))
        await wait_for_refusal(w, "not_allowed", before, bp.user_name(role, node))

    async def charged() -> dict[str, int]:
        status = decode((await (await w.client(bp.ADMIN)).request(
            bus.QUOTA_STATUS, encode(QuotaStatusRequest(namespace=w.namespace)), timeout=10,
        )).data, QuotaReply)  # fmt: skip
        return {u: c.memory_mib for u, c in status.states[0].charges.items()}

    assert await charged() == {first_uid: 2000, w.uid: 2000}
    await _ok(w, bp.NODE_AGENT, bus.QUOTA_RESERVE, hand_on(nxt, first_uid), QuotaReply,
              VICTIM_NODE)  # fmt: skip
    assert await charged() == {nxt["metadata"]["uid"]: 2000, w.uid: 2000}
