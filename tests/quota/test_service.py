"""The quota service over a real nats-server: reserve, release, status, set, events, bad input,
and concurrency across clients and replicas."""

from __future__ import annotations

import asyncio
import json

import msgpack
from quota_testkit import call, eventually, next_event, unique_namespace

from tessera import bus
from tessera.bus import connect
from tessera.models import (
    AllocationEvent,
    ErrorReply,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.settings import NatsSettings


def reserve(ns: str, uid: str, mem: int = 0, cores: int = 0, gpus: int = 1,
            check_only: bool = False) -> QuotaRequest:
    return QuotaRequest(namespace=ns, pod_uid=uid, name=f"pod-{uid}", memory_mib=mem,
                        cores=cores, gpus=gpus, check_only=check_only)


async def set_limits(nc, ns: str, **limits: int | None) -> QuotaReply:
    body = QuotaSetRequest(namespace=ns, limits=QuotaAmount(**limits))
    reply = await call(nc, bus.QUOTA_SET, body)
    assert isinstance(reply, QuotaReply), reply
    return reply


async def test_reserve_is_idempotent_release_frees_and_status_shows_usage(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    await set_limits(nc, ns, memory_mib=4000, gpus=2)

    first = await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p1", mem=3000))
    assert first.ok and first.reason == "reserved"
    retry = await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p1", mem=3000))
    assert retry.ok and retry.reason == "already held"
    assert retry.states[0].used() == QuotaAmount(memory_mib=3000, cores=0, gpus=1)

    refused = await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p2", mem=2000))
    assert not refused.ok
    assert "exceeding resource quota" in refused.reason and "gpumem" in refused.reason

    released = await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="p1"))
    assert released.ok and released.reason == "released"
    again = await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="p1"))
    assert again.ok and "nothing held" in again.reason

    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p2", mem=2000))).ok
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert list(status.states[0].charges) == ["p2"]
    everything = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest())
    assert ns in {s.namespace for s in everything.states}


async def test_check_only_answers_without_holding_and_refusals_publish_exceeded(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    await set_limits(nc, ns, memory_mib=1000)
    fits = await call(nc, bus.QUOTA_RESERVE, reserve(ns, "", mem=1000, check_only=True))
    assert fits.ok
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert status.states[0].charges == {}

    too_big = await call(nc, bus.QUOTA_RESERVE, reserve(ns, "big", mem=1001, check_only=True))
    assert not too_big.ok and "exceeding resource quota" in too_big.reason
    event = await next_event(nc, bus.quota_event_subject(ns, "exceeded"))
    assert event.namespace == ns and event.pod_uid == "big" and event.limits.memory_mib == 1000


async def test_unset_namespace_is_unlimited_and_explicit_zero_blocks(start_quota, nc):
    await start_quota()
    free, blocked = unique_namespace("free"), unique_namespace("blocked")
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(free, "p", mem=10**6, gpus=64))).ok
    await set_limits(nc, blocked, cores=0)
    # A whole-card request (0 MiB at admission, by percentage) is blocked all the same.
    refused = await call(nc, bus.QUOTA_RESERVE, reserve(blocked, "p", mem=0, gpus=1))
    assert not refused.ok and "blocked" in refused.reason
    # A pod that asks no GPU holds nothing and is not refused.
    no_gpu = await call(nc, bus.QUOTA_RESERVE, reserve(blocked, "cpu", gpus=0))
    assert no_gpu.ok and no_gpu.states[0].charges == {}


async def test_limit_changes_while_pods_hold_quota(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    await set_limits(nc, ns, memory_mib=4000)
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "a", mem=3000))).ok

    lowered = await set_limits(nc, ns, memory_mib=2000)
    assert "usage is above the new gpumem limit" in lowered.reason
    assert "a" in lowered.states[0].charges  # running pods keep what they hold
    assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "b", mem=1))).ok
    changed = await next_event(nc, bus.quota_event_subject(ns, "changed"))
    assert changed.namespace == ns

    await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="a"))
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "b", mem=2000))).ok
    assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "c", mem=1))).ok

    await set_limits(nc, ns)  # every limit unset: unlimited
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "c", mem=50_000))).ok


async def test_limit_updates_are_atomic_no_reservation_slips_through(start_quota, nc):
    """While limits flip between two values, no reservation ever sees 'no limit'."""
    await start_quota()
    ns = unique_namespace()
    await set_limits(nc, ns, memory_mib=100)

    async def flip() -> None:
        for i in range(30):
            await set_limits(nc, ns, memory_mib=100 + (i % 2))

    async def try_big() -> list[bool]:
        return [
            (await call(nc, bus.QUOTA_RESERVE, reserve(ns, f"big{i}", mem=500))).ok
            for i in range(30)
        ]

    _, results = await asyncio.gather(flip(), try_big())
    assert not any(results)


async def test_concurrent_reservations_from_many_clients_and_two_replicas_never_exceed(
    start_quota, nats_url
):
    first = await start_quota()
    await start_quota()  # a second replica behind the same subjects (queue group)
    ns = unique_namespace("race")
    clients = [await connect(NatsSettings(NATS_URL=nats_url), name=f"c{i}") for i in range(6)]
    try:
        await set_limits(clients[0], ns, memory_mib=10 * 1000, gpus=12)

        async def one(i: int) -> object:
            client = clients[i % len(clients)]
            return await call(client, bus.QUOTA_RESERVE, reserve(ns, f"pod{i}", mem=1000),
                              timeout=20)

        replies = await asyncio.gather(*(one(i) for i in range(60)))
        assert all(isinstance(r, QuotaReply) for r in replies), replies
        granted = {f"pod{i}" for i, r in enumerate(replies) if r.ok}
        assert len(granted) == 10

        state = await first.store.full_state(ns)
        assert state is not None and set(state.charges) == granted
        assert state.used().memory_mib == 10_000

        # Every client retries everything: the winners stay winners, nobody else gets in.
        retries = await asyncio.gather(*(one(i) for i in range(60)))
        assert {f"pod{i}" for i, r in enumerate(retries) if r.ok} == granted
        assert all(r.reason == "already held" for r in retries if r.ok)
    finally:
        for client in clients:
            await client.close()


async def test_bad_input_gets_an_error_reply_and_the_service_keeps_serving(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    negative = msgpack.packb({"schema": "QuotaRequest", "version": 1,
                              "data": {"namespace": ns, "pod_uid": "p", "memory_mib": -5}})
    malformed = msgpack.packb({"schema": "QuotaRequest", "version": 1,
                               "data": {"namespace": ns, "pod_uid": "p", "memory_mib": "8Gi"}})
    future = msgpack.packb({"schema": "QuotaRequest", "version": 99, "data": {"namespace": ns}})
    cases = [
        (bus.QUOTA_RESERVE, b"\xff\x00garbage", "not msgpack"),
        (bus.QUOTA_RESERVE, json.dumps({"namespace": ns}).encode(), "QuotaRequest"),
        (bus.QUOTA_RESERVE, negative, "greater than or equal to 0"),
        (bus.QUOTA_RESERVE, malformed, "memory_mib"),
        (bus.QUOTA_RESERVE, future, "version 99"),
        (bus.QUOTA_RESERVE, QuotaStatusRequest(namespace=ns), "expected a QuotaRequest"),
        (bus.QUOTA_RESERVE, reserve(ns, "p", mem=1 << 50), "absurdly large"),
        (bus.QUOTA_RESERVE, reserve("Not_A_Namespace", "p"), "not a valid Kubernetes namespace"),
        (bus.QUOTA_RESERVE, reserve(ns, ""), "needs pod_uid"),
        (bus.QUOTA_RESERVE, reserve(ns, "x" * 200), "pod_uid is longer"),
        (bus.QUOTA_RELEASE, QuotaRequest(namespace=ns), "needs pod_uid"),
        (bus.QUOTA_STATUS, QuotaStatusRequest(namespace=unique_namespace("nobody")),
         "unknown namespace"),
        (bus.QUOTA_STATUS, b"", "not msgpack"),
        (bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=QuotaAmount(memory_mib=-1)),
         "negative"),
        (bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=QuotaAmount(),
                                        source="resourcequota/x"), "reserved"),
        (bus.QUOTA_SET, b"\x00" * 100_000, "QuotaSetRequest"),
    ]
    for subject, body, expected in cases:
        reply = await call(nc, subject, body)
        assert isinstance(reply, ErrorReply), (subject, body, reply)
        assert expected in reply.reason, (expected, reply.reason)
    # Still serving, and nothing was charged by any of the above.
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "ok", mem=1))).ok
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert list(status.states[0].charges) == ["ok"]


async def test_a_released_allocation_event_frees_the_pods_quota(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    await set_limits(nc, ns, gpus=1)
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p1", mem=10))).ok
    await bus.publish_event(nc.jetstream(), AllocationEvent(
        action="released", node="node-a", pod_uid="p1", namespace=ns, name="pod-p1"))

    async def freed() -> bool:
        status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
        return status.states[0].charges == {}

    await eventually(freed)
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p2", mem=10))).ok


async def test_the_service_is_discoverable_as_a_nats_micro_service(start_quota, nc):
    service = await start_quota()
    msg = await nc.request(f"$SRV.INFO.{bus.QUOTA_SERVICE}", b"", timeout=2)
    info = json.loads(msg.data)
    assert info["name"] == bus.QUOTA_SERVICE
    subjects = {e["subject"] for e in info["endpoints"]}
    assert {bus.QUOTA_RESERVE, bus.QUOTA_RELEASE, bus.QUOTA_STATUS, bus.QUOTA_SET} <= subjects
    assert service.instance
