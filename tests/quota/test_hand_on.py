"""A charge handed on from one pod to another in one write (`QuotaRequest.handed_from`): a DRA
claim shared by two pods of a node is booked under its first pod; when that pod ends, the DRA
driver books it under the next one. The namespace's usage never drops the slice nor counts it
twice, even at its limit, over a real nats-server."""

from __future__ import annotations

from quota_testkit import call, unique_namespace

from tessera import bus
from tessera.codec import decode
from tessera.models import (
    ErrorReply,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaShare,
    QuotaState,
    QuotaStatusRequest,
)


def charge(ns: str, uid: str, mem: int, handed_from: str = "", check_only: bool = False,
           keeps: QuotaShare | None = None) -> QuotaRequest:  # fmt: skip
    return QuotaRequest(namespace=ns, pod_uid=uid, name=f"pod-{uid}", memory_mib=mem, gpus=1,
                        handed_from=handed_from, check_only=check_only,
                        handed_from_keeps=keeps)  # fmt: skip


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
                charge(ns, "", 1000, handed_from="first", check_only=True),
                # what the ended pod keeps: only with handed_from, never more than it holds
                charge(ns, "next", 1000, keeps=QuotaShare(memory_mib=1)),
                charge(ns, "next", 500, handed_from="first",
                       keeps=QuotaShare(memory_mib=1001, gpus=1)),
                charge(ns, "next", 500, handed_from="first",
                       keeps=QuotaShare(memory_mib=500, gpus=2)),
                charge(ns, "next", 500, handed_from="first",
                       keeps=QuotaShare(memory_mib=1 << 40))):  # fmt: skip
        reply = await call(nc, bus.QUOTA_RESERVE, bad)
        assert isinstance(reply, ErrorReply), (bad, reply)
    assert await charges(nc, ns) == ({"first": 1000}, 1000)
    released = await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="first"))
    assert released.ok


async def test_an_ended_pod_keeping_other_claims_hands_one_on_in_one_write(start_quota, nc):
    """The ended pod holds two claims; one is shared with the next pod. One write shrinks its
    charge to the claim it keeps and holds the next pod's: the namespace's usage, read from
    every write the quota service makes to its state (a KV watch), never counts the handed
    slice twice nor drops it, and a namespace at its limit hands on too."""
    service = await start_quota()
    ns = unique_namespace()
    assert (await call(nc, bus.QUOTA_SET, QuotaSetRequest(
        namespace=ns, limits=QuotaAmount(memory_mib=4000, gpus=2)))).ok  # fmt: skip
    both = QuotaRequest(namespace=ns, pod_uid="first", name="pod-first", memory_mib=4000, gpus=2)
    assert (await call(nc, bus.QUOTA_RESERVE, both)).ok
    assert await charges(nc, ns) == ({"first": 4000}, 4000)
    watcher = await service.store.counters.watch(ns)
    assert await watcher.updates(5) is not None  # the state as it stands
    assert await watcher.updates(5) is None  # then the watch's end-of-history marker

    # the next pod's charge is the shared claim (3000 MiB, 1 GPU); the first keeps 1000, 1 GPU
    hand = charge(ns, "next", 3000, handed_from="first",
                  keeps=QuotaShare(memory_mib=1000, gpus=1))  # fmt: skip
    moved = await call(nc, bus.QUOTA_RESERVE, hand)
    assert isinstance(moved, QuotaReply) and moved.ok, moved
    assert await charges(nc, ns) == ({"first": 1000, "next": 3000}, 4000)
    again = await call(nc, bus.QUOTA_RESERVE, hand)  # a retry (its reply lost): nothing changes
    assert again.ok and again.reason == "already held", again
    assert await charges(nc, ns) == ({"first": 1000, "next": 3000}, 4000)
    # every state written meanwhile (the hand-on's one write; a background fold moves charges
    # into the totals and changes no total): 4000 MiB and 2 GPUs in use throughout
    written = [usage_of((await watcher.updates(5)).value)]
    while written[-1][0].get("next") != 3000 and written[-1][0] != {}:
        written.append(usage_of((await watcher.updates(5)).value))
    await watcher.stop()
    assert all(used == (4000, 2) for _charges, used in written), written
    assert written[0][0] in ({"first": 1000, "next": 3000}, {}), written  # no step between

    # settled (folded into its own key): it shrinks the same way, its total back in the journal
    await service.store.fold(ns, 0)
    assert await service.store.settled_charge(ns, "first") is not None
    last = await call(nc, bus.QUOTA_RESERVE, charge(
        ns, "last", 500, handed_from="first", keeps=QuotaShare(memory_mib=500)))  # fmt: skip
    assert last.ok, last
    assert await charges(nc, ns) == ({"first": 500, "next": 3000, "last": 500}, 4000)
    # the ended pod's release frees what it kept, nothing of the pods it handed on to
    assert (await call(nc, bus.QUOTA_RELEASE, QuotaRequest(namespace=ns, pod_uid="first"))).ok
    assert await charges(nc, ns) == ({"next": 3000, "last": 500}, 3500)


def usage_of(raw: bytes) -> tuple[dict[str, int], tuple[int, int]]:
    """A written state's journal (pod: MiB) and what the namespace uses (MiB, GPUs)."""
    state = decode(raw, QuotaState)
    used = state.used()
    return ({u: c.memory_mib for u, c in state.charges.items()},
            (used.memory_mib or 0, used.gpus or 0))  # fmt: skip
