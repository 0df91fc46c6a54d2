"""Marking a bind in the ledger when the reservation lapsed meanwhile (real NATS ledger).

A reservation holds capacity only until it expires. A cluster bind that outlasts it lets other
pods be given its room; recording the bind must then re-check the fit, or the card is
overfilled. Refused, the pod (already bound in the cluster) loses its grant and never runs on it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from tessera.scheduler.cards import build_cards, over_capacity
from tessera.scheduler.ledger import (
    LedgerWriter,
    ReservationRequest,
    RoomTakenError,
)
from tessera.scheduler.rules import FitContext, PodOptions

from tessera import bus, hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.hami import parse_pod_request
from tessera.models import Allocation, AllocationState, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .conftest import MakeService, http_client, unique
from .factories import GIB, container, node, pod
from .test_extender import bind_call, filter_call, setup_node

T0 = 1_000_000.0
TTL = 30.0


def reservation(registration: NodeRegistration, uid: str, memory_mib: int, now: float,
                ) -> ReservationRequest:  # fmt: skip
    spec = pod(container(mem=memory_mib), uid=uid)
    return ReservationRequest(
        registration=registration, cordoned=frozenset(),
        request=parse_pod_request(spec, TesseraSettings()),
        ctx_factory=lambda: FitContext(PodOptions()),
        template=Allocation(pod_uid=uid, namespace="ns", name=uid,
                            node=registration.node, containers=[]),
        now=now, ttl_s=TTL,
    )  # fmt: skip


async def read(buckets: Buckets, name: str) -> NodeLedger:
    entry = await bus.read(buckets.ledger, name, NodeLedger)
    assert entry is not None
    return entry.value


def overfilled(registration: NodeRegistration, ledger: NodeLedger, now: float) -> list[str]:
    """Over-capacity cards counting every bound/reserved-and-live allocation at `now`."""
    return over_capacity(build_cards(registration, ledger.allocations.values(), now))


async def test_lapsed_reservation_whose_room_was_given_away_is_not_marked_bound(
    buckets: Buckets,
) -> None:
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    writer = LedgerWriter(buckets.ledger)
    await writer.reserve(reservation(registration, "a", 60 * GIB, T0))
    later = T0 + TTL + 1  # a's reservation lapsed: its 60 GiB count for nothing now
    await writer.reserve(reservation(registration, "b", 60 * GIB, later))
    before = await read(buckets, registration.node)
    with pytest.raises(RoomTakenError, match="memory MiB 61440 in use \\+ 61440 > 81920"):
        await writer.mark_bound(registration.node, "a", later, registration=registration)
    after = await read(buckets, registration.node)
    assert after == before  # nothing written
    assert after.allocations["a"].state == AllocationState.RESERVED
    # b's room stays b's: the card holds b alone; a marked bound would have overfilled it.
    assert overfilled(registration, after, later) == []
    a_bound = after.allocations["a"].model_copy(update={"expires_at": None,
                                                        "state": AllocationState.BOUND})
    written = after.model_copy(update={"allocations": {**after.allocations, "a": a_bound}})
    assert overfilled(registration, written, later) != []
    # Without the node's registration a lapsed reservation cannot be checked: refused too.
    with pytest.raises(RoomTakenError, match="registration is unknown"):
        await writer.mark_bound(registration.node, "a", later)


async def test_live_or_still_fitting_reservations_are_marked_bound(buckets: Buckets) -> None:
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    writer = LedgerWriter(buckets.ledger)
    await writer.reserve(reservation(registration, "a", 30 * GIB, T0))
    await writer.reserve(reservation(registration, "b", 30 * GIB, T0 + 1))
    # The normal path: live reservation (no registration needed, as before).
    result = await writer.mark_bound(registration.node, "a", T0 + 2)
    assert result.value.allocations["a"].state == AllocationState.BOUND
    # Lapsed, but nobody took its room (a's 30 + b's 30 of 80 GiB): it is bound.
    late = T0 + 1 + TTL + 5
    result = await writer.mark_bound(registration.node, "b", late, registration=registration)
    ledger = await read(buckets, registration.node)
    assert ledger.allocations["b"].state == AllocationState.BOUND
    assert ledger.allocations["b"].expires_at is None
    assert overfilled(registration, ledger, late) == []


async def test_bind_outlasting_its_reservation_fails_and_withdraws_the_grant(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """Through the extender: pod a's cluster bind takes longer than its reservation (and its
    claim); meanwhile another replica gives a's room to pod b. a's bind reports a clear error,
    its allocation leaves the ledger (the node agent serves it nothing) and its pod loses the
    grant annotations; b keeps its room; no card is overfilled."""
    skew = [0.0]
    service = await make_service(config={"sweep_interval_s": 3600.0},
                                 clock=lambda: time.time() + skew[0])  # fmt: skip
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    name = await setup_node(buckets, service, registration)
    a = cluster.add_pod(pod(container(mem=60 * GIB)))
    b_uid = unique("b")
    real_bind = cluster.bind_pod

    async def slow_bind(namespace: str, pod_name: str, uid: str, node_name: str) -> None:
        if pod_name == a["metadata"]["name"]:
            skew[0] += 3 * service.config.claim_ttl_s + service.settings.reservation_ttl_s
            # Another replica's reservation, decided at write time: a's lapsed one holds nothing.
            other = LedgerWriter(buckets.ledger)
            await other.reserve(reservation(registration, b_uid, 60 * GIB, time.time() + skew[0]))
        await real_bind(namespace, pod_name, uid, node_name)

    cluster.bind_pod = slow_bind  # type: ignore[method-assign]
    async with http_client(service) as client:
        assert (await filter_call(client, a, [name]))["nodenames"] == [name]
        error = await bind_call(client, a, name)
    assert "reservation lapsed" in error and "given to other pods" in error, error
    ledger = await read(buckets, name)
    assert a["metadata"]["uid"] not in ledger.allocations
    assert ledger.allocations[b_uid].state == AllocationState.RESERVED
    assert overfilled(registration, ledger, time.time() + skew[0]) == []
    annotations = cluster.pods[("default", a["metadata"]["name"])]["metadata"]["annotations"]
    assert annotations[hami.ANN_BIND_PHASE] == hami.BIND_PHASE_FAILED
    assert hami.ANN_DEVICES_TO_ALLOCATE not in annotations
    assert a["metadata"]["uid"] not in service.index.pod_nodes


async def test_reservation_swept_during_the_bind_fails_it_and_withdraws_the_grant(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """Pod a's reservation is swept (it lapsed, and the pod was not yet bound in the cluster)
    while its cluster bind is on the wire: the bind reports the reservation gone instead of
    success, and the pod loses the grant annotations (its room may be another pod's now)."""
    service = await make_service(config={"sweep_interval_s": 3600.0})
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    name = await setup_node(buckets, service, registration)
    a = cluster.add_pod(pod(container(mem=60 * GIB)))
    real_bind = cluster.bind_pod

    async def bind_while_swept(namespace: str, pod_name: str, uid: str, node_name: str) -> None:
        writer = LedgerWriter(buckets.ledger)
        await writer.release(node_name, uid)  # what the sweep does to a lapsed reservation
        await real_bind(namespace, pod_name, uid, node_name)

    cluster.bind_pod = bind_while_swept  # type: ignore[method-assign]
    async with http_client(service) as client:
        assert (await filter_call(client, a, [name]))["nodenames"] == [name]
        error = await bind_call(client, a, name)
    assert "reservation was gone" in error, error
    annotations = cluster.pods[("default", a["metadata"]["name"])]["metadata"]["annotations"]
    assert annotations[hami.ANN_BIND_PHASE] == hami.BIND_PHASE_FAILED
    assert hami.ANN_DEVICES_TO_ALLOCATE not in annotations


async def test_sweep_does_not_adopt_a_bound_pod_whose_room_was_given_away(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """A replica bound pod a in the cluster and died before recording it; a's reservation
    lapsed, and another replica gave its room to b. The sweep finds a bound in the cluster but
    must not mark it bound on b's room: a's allocation goes and its grant is withdrawn."""
    skew = [0.0]
    service = await make_service(config={"sweep_interval_s": 3600.0},
                                 clock=lambda: time.time() + skew[0])  # fmt: skip
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    name = await setup_node(buckets, service, registration)
    a = cluster.add_pod(pod(container(mem=60 * GIB)))
    async with http_client(service) as client:
        assert (await filter_call(client, a, [name]))["nodenames"] == [name]
    await cluster.bind_pod("default", a["metadata"]["name"], a["metadata"]["uid"], name)
    skew[0] += service.settings.reservation_ttl_s + 5
    b_uid = unique("b")
    other = LedgerWriter(buckets.ledger)
    await other.reserve(reservation(registration, b_uid, 60 * GIB, time.time() + skew[0]))
    for _ in range(200):  # the index has seen b's reservation
        entry = service.index.entries[name]
        if entry.ledger is not None and b_uid in entry.ledger.allocations:
            break
        await asyncio.sleep(0.02)
    await service.scheduler.sweep()
    ledger = await read(buckets, name)
    assert a["metadata"]["uid"] not in ledger.allocations
    assert b_uid in ledger.allocations
    assert overfilled(registration, ledger, time.time() + skew[0]) == []
    annotations = cluster.pods[("default", a["metadata"]["name"])]["metadata"]["annotations"]
    assert annotations[hami.ANN_BIND_PHASE] == hami.BIND_PHASE_FAILED
    assert hami.ANN_DEVICES_TO_ALLOCATE not in annotations
