"""A restarted scheduler releases the allocations of pods the cluster no longer has before it
reports ready (a second `make demo` on one state directory, pods deleted while no scheduler or
NATS was up), and never one of a pod that may still be being created."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tessera.scheduler.stale import (
    GONE,
    Listing,
    UnlistedRecorder,
    stale_allocations,
    verdict,
)

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode
from tessera.models import Allocation, AllocationEvent, AllocationState, DeviceGrant, NodeLedger

from .conftest import MakeService, register, unique, wait_until
from .factories import GIB, container, node, pod

NOW = 10_000.0


def alloc(uid: str, state: str = "allocated", created: float = NOW - 600,
          expires: float | None = None) -> Any:  # fmt: skip
    return SimpleNamespace(pod_uid=uid, state=state, created_at=created, expires_at=expires,
                           namespace="ns", name=uid, active=True)  # fmt: skip


def test_verdict_releases_only_pods_gone_before_the_listing() -> None:
    placed = dict.fromkeys(["live", "done", "gone", "new", "r"], "n1")
    pods = [{"metadata": {"uid": "live"}, "status": {"phase": "Running"}},
            {"metadata": {"uid": "done"}, "status": {"phase": "Succeeded"}},
            {"metadata": {"uid": ["hostile"]}}, "not a pod"]  # fmt: skip
    listing = Listing.of_pods(pods, NOW, placed)
    assert set(listing.unlisted) == {"gone", "new", "r"}
    assert listing.finished == {"done": "Succeeded"}
    assert verdict(alloc("live"), listing) == ""
    assert verdict(alloc("gone"), listing) == GONE
    assert verdict(alloc("done"), listing) == "pod succeeded while no scheduler watched it"
    # Written while the cluster was being listed (or after, on a clock a little ahead): its pod
    # may be too new for the listing.
    assert verdict(alloc("new", created=NOW - 1), listing) == ""
    assert verdict(alloc("new", created=NOW + 3), listing) == ""
    # A reservation still within its TTL is never freed under a pod being created; one past its
    # TTL is (the sweeper would drop it anyway).
    assert verdict(alloc("r", "reserved", expires=NOW + 20), listing) == ""
    assert verdict(alloc("r", "reserved", expires=None), listing) == ""
    assert verdict(alloc("r", "reserved", expires=NOW - 1), listing) == GONE


def test_the_rebuilds_listing_strikes_out_every_listed_uid_read_or_skipped() -> None:
    placed = dict.fromkeys(["a", "b", "c"], "n1")
    recorder = UnlistedRecorder(lambda uids, _s: [False] * len(uids), placed)
    assert recorder(["a", None, "x"], [None] * 3) == [False] * 3
    recorder([["unhashable"], "b"], [None, None])  # a hostile page: the rest still counts
    listing = recorder.listing(NOW)
    assert set(listing.unlisted) == {"c"} and listing.finished == {}
    assert verdict(alloc("a"), listing) == "" and verdict(alloc("c"), listing) == GONE


def test_stale_allocations_names_node_and_pod() -> None:
    ledgers = {"n1": SimpleNamespace(allocations={"gone": alloc("gone"), "live": alloc("live")}),
               "n2": SimpleNamespace(allocations={})}  # fmt: skip
    inactive = alloc("old")
    inactive.active = False
    ledgers["n2"].allocations["old"] = inactive
    placed = {"gone": "n1", "live": "n1", "old": "n2", "lost": "n3"}  # the index's map
    found = stale_allocations(placed, ledgers, Listing.of_pods(
        [{"metadata": {"uid": "live"}}], NOW, placed))
    assert [(s.node, s.pod_uid, s.namespace, s.name, s.why) for s in found] == [
        ("n1", "gone", "ns", "gone", GONE)
    ]


async def test_a_restart_right_after_the_last_placement_frees_the_gone_pods_in_seconds(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster,
) -> None:
    """`make demo` stopped and started again at once: the previous run's allocations were written
    a second before the restarted scheduler lists the cluster. They were read before the listing
    began, so they are released before ready, not one reconcile interval (here 600 s) later."""
    name = unique("grace")
    await register(buckets, node(name, gpus=1, memory_mib=10 * GIB))
    just_now = time.time() - 1
    entries = {"gone-uid": Allocation(
        pod_uid="gone-uid", namespace="default", name="gone", node=name,
        containers=grant(name, 0), state=AllocationState.ALLOCATED,
        created_at=just_now, updated_at=just_now)}  # fmt: skip
    await bus.cas_update(buckets.ledger, name, NodeLedger,
                         lambda _c: NodeLedger(node=name, allocations=entries))  # fmt: skip
    started = time.monotonic()
    service = await make_service(config={"reconcile_interval_s": 600.0})  # returns once ready
    assert "gone-uid" not in service.index.pod_nodes
    assert time.monotonic() - started < 60
    current = await bus.read(buckets.ledger, name, NodeLedger)
    assert current is None or not any(a.active for a in current.value.allocations.values())


def grant(node_name: str, index: int) -> list[list[DeviceGrant]]:
    return [[DeviceGrant(uuid=f"GPU-{node_name}-{index}", type="NVIDIA-H100",
                         memory_mib=10 * GIB, cores=0)]]  # fmt: skip


async def test_restarted_scheduler_releases_stale_allocations_before_ready(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any,
) -> None:
    """What a previous run left in NATS: a bound pod deleted while no scheduler ran (released
    before ready, with an event saying why), a live pod (kept), and a reservation within its
    TTL of a pod the cluster does not list yet (kept)."""
    name = unique("stale")
    await register(buckets, node(name, gpus=3, memory_mib=10 * GIB))
    long_ago = time.time() - 600
    live = cluster.add_pod(pod(container(mem=10 * GIB), name="live"))
    live_uid = live["metadata"]["uid"]
    entries = {
        "gone-uid": Allocation(pod_uid="gone-uid", namespace="default", name="gone", node=name,
                               containers=grant(name, 0), state=AllocationState.ALLOCATED,
                               created_at=long_ago, updated_at=long_ago),
        live_uid: Allocation(pod_uid=live_uid, namespace="default", name="live", node=name,
                             containers=grant(name, 1), state=AllocationState.ALLOCATED,
                             created_at=long_ago, updated_at=long_ago),
        "creating-uid": Allocation(pod_uid="creating-uid", namespace="default", name="creating",
                                   node=name, containers=grant(name, 2), created_at=long_ago,
                                   expires_at=time.time() + 120),
    }  # fmt: skip
    await bus.cas_update(buckets.ledger, name, NodeLedger,
                         lambda _c: NodeLedger(node=name, allocations=entries))  # fmt: skip
    released: list[AllocationEvent] = []

    async def on_released(msg: Any) -> None:
        released.append(decode(msg.data, AllocationEvent))

    sub = await nc.subscribe(bus.alloc_event_subject(name, "released"), cb=on_released)
    await bus.flush(nc)  # in place before another connection publishes
    try:
        service = await make_service()  # returns once ready
        # Already gone from the ledger when ready is reported: nothing waits for a periodic pass.
        current = await bus.read(buckets.ledger, name, NodeLedger)
        assert current is not None
        assert set(current.value.allocations) == {live_uid, "creating-uid"}
        assert "gone-uid" not in service.index.pod_nodes
        await wait_until(lambda: bool(released), 30)
        assert [(e.pod_uid, e.name, e.reason) for e in released] == [("gone-uid", "gone", GONE)]
        # Its card is free for a new pod at once; the live pod's card is not.
        newcomer = cluster.add_pod(pod(container(mem=10 * GIB), name="newcomer"))
        outcome = await service.scheduler.filter(newcomer, [name])
        assert outcome.nodenames == [name], outcome
        held = service.index.entries[name].ledger
        assert held is not None
        placed = held.allocations[newcomer["metadata"]["uid"]].containers
        assert [g.uuid for g in placed[0]] == [f"GPU-{name}-0"]
    finally:
        await sub.unsubscribe()
