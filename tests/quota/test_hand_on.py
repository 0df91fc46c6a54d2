"""A charge handed on from one pod to another in one write (`QuotaRequest.handed_from`): a DRA
claim shared by two pods of a node is booked under its first pod; when that pod ends, the DRA
driver books it under the next one. The namespace's usage never drops the slice nor counts it
twice, even at its limit, over a real nats-server."""

from __future__ import annotations

from quota_testkit import call, unique_namespace

from tessera import bus
from tessera.models import (
    ErrorReply,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)


def charge(ns: str, uid: str, mem: int, handed_from: str = "", check_only: bool = False
           ) -> QuotaRequest:  # fmt: skip
    return QuotaRequest(namespace=ns, pod_uid=uid, name=f"pod-{uid}", memory_mib=mem, gpus=1,
                        handed_from=handed_from, check_only=check_only)  # fmt: skip


async def charges(nc, ns: str) -> tuple[dict[str, int], int]:
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    [state] = status.states
    return {u: c.memory_mib for u, c in state.charges.items()}, state.used().memory_mib


async def test_a_namespace_at_its_limit_hands_a_charge_on_in_one_write(start_quota, nc):
    service = await start_quota()
    ns = unique_namespace()
    reply = await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns,
                                                          limits=QuotaAmount(memory_mib=4000)))
    assert reply.ok
    assert (await call(nc, bus.QUOTA_RESERVE, charge(ns, "first", 3000))).ok
    # charged twice, it would not fit: the old way (charge the next, then shrink the first)
    # could never hand it on in a namespace near its limit
    assert not (await call(nc, bus.QUOTA_RESERVE, charge(ns, "next", 3000))).ok
    # too big even with the first pod's charge freed: refused, nothing written
    too_big = await call(nc, bus.QUOTA_RESERVE, charge(ns, "next", 5000, handed_from="first"))
    assert isinstance(too_big, QuotaReply) and not too_big.ok
    assert await charges(nc, ns) == ({"first": 3000}, 3000)

    moved = await call(nc, bus.QUOTA_RESERVE, charge(ns, "next", 3000, handed_from="first"))
    assert isinstance(moved, QuotaReply) and moved.ok, moved
    assert await charges(nc, ns) == ({"next": 3000}, 3000)
    again = await call(nc, bus.QUOTA_RESERVE, charge(ns, "next", 3000, handed_from="first"))
    assert again.ok and await charges(nc, ns) == ({"next": 3000}, 3000)  # idempotent

    # a settled charge (folded into its own key) hands on the same way, its key deleted
    await service.store.fold(ns, 0)
    assert await service.store.settled_charge(ns, "next") is not None
    last = await call(nc, bus.QUOTA_RESERVE, charge(ns, "last", 3000, handed_from="next"))
    assert last.ok, last
    assert await charges(nc, ns) == ({"last": 3000}, 3000)
    assert await service.store.settled_charge(ns, "next") is None


async def test_a_bad_hand_on_gets_an_error_and_changes_nothing(start_quota, nc):
    await start_quota()
    ns = unique_namespace()
    assert (await call(nc, bus.QUOTA_RESERVE, charge(ns, "first", 1000))).ok
    for bad in (charge(ns, "next", 1000, handed_from="../first"),
                charge(ns, "next", 1000, handed_from="x" * 129),
                charge(ns, "first", 1000, handed_from="first"),
                charge(ns, "", 1000, handed_from="first", check_only=True)):  # fmt: skip
        reply = await call(nc, bus.QUOTA_RESERVE, bad)
        assert isinstance(reply, ErrorReply), (bad, reply)
    assert await charges(nc, ns) == ({"first": 1000}, 1000)
    released = await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="first"))
    assert released.ok
