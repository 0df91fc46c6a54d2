"""Marking a bind in the ledger when the reservation lapsed meanwhile (real NATS ledger).

A reservation holds capacity only until it expires. A cluster bind that outlasts it lets other
pods be given its room; recording the bind must then re-check the fit, or the card is
overfilled. Refused, the pod (already bound in the cluster) loses its grant and never runs on it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from tessera.scheduler.cards import build_cards, over_capacity
from tessera.scheduler.ledger import (
    LedgerWriter,
    ReservationRequest,
    RoomTakenError,
)
from tessera.scheduler.rules import FitContext, PodOptions
from tessera.scheduler.runtime import SchedulerService

from tessera import bus, hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.hami import parse_pod_request
from tessera.models import Allocation, AllocationState, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .conftest import MakeService, http_client, unique, wait_until
from .factories import GIB, container, node, pod
from .test_extender import bind_call, filter_call, setup_node
from .test_hami_migration import hami_pod

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


@dataclass
class LapsingBind:
    """One replica whose clock the test moves (`skew`) and whose periodic sweep never runs, one
    80 GiB card, and pod a (60 GiB) in the cluster, about to be filtered there."""

    service: SchedulerService
    registration: NodeRegistration
    a: dict[str, Any]
    skew: list[float]

    @property
    def node(self) -> str:
        return self.registration.node

    def now(self) -> float:
        return time.time() + self.skew[0]


async def lapsing_bind(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster,
    config: dict[str, Any] | None = None,
) -> LapsingBind:
    skew = [0.0]
    service = await make_service(config={"sweep_interval_s": 3600.0, **(config or {})},
                                 clock=lambda: time.time() + skew[0])  # fmt: skip
    registration = node(unique("n"), gpus=1, memory_mib=80 * GIB)
    await setup_node(buckets, service, registration)
    return LapsingBind(service, registration, cluster.add_pod(pod(container(mem=60 * GIB))), skew)


# Who is given a's 60 GiB while a's reservation has lapsed: another replica's reservation (in
# the ledger), or a pod HAMi's scheduler placed there (foreign.py: known from the cluster only,
# never in the ledger). The re-fit must see both.
TAKERS = ["tessera-reservation", "hami-pod"]


async def give_room_away(
    setup: LapsingBind, taker: str, buckets: Buckets, cluster: InMemoryCluster
) -> str:
    """Pod b takes 60 GiB of the card as the replica now sees it; returns b's uid."""
    if taker == "hami-pod":
        held = cluster.add_pod(hami_pod(
            unique("hami-b"), setup.node, f"GPU-{setup.node}-0,NVIDIA-A100,{60 * GIB},0:;",
            mem=60 * GIB, cores=0,
        ))  # fmt: skip
        await wait_until(lambda: setup.service.index.foreign_allocations(setup.node))
        return str(held["metadata"]["uid"])
    b_uid = unique("b")
    # Another replica's reservation, decided at write time: a's lapsed one holds nothing.
    await LedgerWriter(buckets.ledger).reserve(
        reservation(setup.registration, b_uid, 60 * GIB, setup.now()))
    await wait_until(lambda: b_uid in (setup.service.index.entries[setup.node].ledger
                                       or NodeLedger(node="")).allocations)  # fmt: skip
    return b_uid


async def assert_b_kept_its_room(setup: LapsingBind, taker: str, b_uid: str,
                                 buckets: Buckets, cluster: InMemoryCluster) -> None:  # fmt: skip
    """a holds nothing (ledger, annotations); b still holds its room; no card is overfilled
    counting every consumer (the ledger and HAMi's pods)."""
    a = setup.a
    ledger = await read(buckets, setup.node)
    assert a["metadata"]["uid"] not in ledger.allocations
    foreign = setup.service.index.foreign_allocations(setup.node)
    if taker == "hami-pod":
        assert [f.pod_uid for f in foreign] == [b_uid]
    else:
        assert ledger.allocations[b_uid].state == AllocationState.RESERVED
    held = [*ledger.allocations.values(), *foreign]
    assert over_capacity(build_cards(setup.registration, held, setup.now())) == []
    assert_grant_withdrawn(cluster, a)


def assert_grant_withdrawn(cluster: InMemoryCluster, spec: dict[str, Any]) -> None:
    """The pod, bound in the cluster, lost its grant: marked failed as HAMi marks a failed bind,
    no `vgpu-devices-to-allocate` a ledger rebuild could restore it from."""
    annotations = cluster.pods[("default", spec["metadata"]["name"])]["metadata"]["annotations"]
    assert annotations[hami.ANN_BIND_PHASE] == hami.BIND_PHASE_FAILED
    assert hami.ANN_DEVICES_TO_ALLOCATE not in annotations


async def filter_and_bind(
    setup: LapsingBind, cluster: InMemoryCluster, during_bind: Callable[[], Awaitable[None]]
) -> str:
    """Pod a through the extender (filter, then bind), `during_bind` running while its cluster
    bind is on the wire; returns the bind's error."""
    real_bind = cluster.bind_pod

    async def bind(namespace: str, pod_name: str, uid: str, node_name: str) -> None:
        if uid == setup.a["metadata"]["uid"]:
            await during_bind()
        await real_bind(namespace, pod_name, uid, node_name)

    cluster.bind_pod = bind  # type: ignore[method-assign]
    async with http_client(setup.service) as client:
        assert (await filter_call(client, setup.a, [setup.node]))["nodenames"] == [setup.node]
        return await bind_call(client, setup.a, setup.node)


@pytest.mark.parametrize("taker", TAKERS)
async def test_bind_outlasting_its_reservation_fails_and_withdraws_the_grant(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, taker: str
) -> None:
    """Through the extender: pod a's cluster bind takes longer than its reservation (and its
    claim); meanwhile its room is given to pod b. a's bind reports a clear error, its
    allocation leaves the ledger (the node agent serves it nothing) and its pod loses the grant
    annotations; b keeps its room; no card is overfilled."""
    setup = await lapsing_bind(make_service, buckets, cluster)
    service = setup.service
    taken: list[str] = []

    async def slow() -> None:
        setup.skew[0] += 3 * service.config.claim_ttl_s + service.settings.reservation_ttl_s
        taken.append(await give_room_away(setup, taker, buckets, cluster))

    error = await filter_and_bind(setup, cluster, slow)
    assert "reservation lapsed" in error and "given to other pods" in error, error
    await assert_b_kept_its_room(setup, taker, taken[0], buckets, cluster)
    assert setup.a["metadata"]["uid"] not in service.index.pod_nodes


async def test_reservation_swept_during_the_bind_fails_it_and_withdraws_the_grant(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """Pod a's reservation is swept (it lapsed, and the pod was not yet bound in the cluster)
    while its cluster bind is on the wire: a bind that writes the bound mark reports the
    reservation gone instead of success, and the pod loses the grant annotations (its room may
    be another pod's now)."""
    setup = await lapsing_bind(make_service, buckets, cluster, {"mark_bound_at_bind": True})

    async def swept() -> None:  # what the sweep does to a lapsed reservation
        await LedgerWriter(buckets.ledger).release(setup.node, setup.a["metadata"]["uid"])

    error = await filter_and_bind(setup, cluster, swept)
    assert "reservation was gone" in error, error
    assert_grant_withdrawn(cluster, setup.a)


async def test_reservation_gone_under_a_bind_that_left_its_mark_withdraws_the_grant(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """The bind left the bound mark to the Allocate (the default), and before any came the
    reservation was released by another replica (what the mark's CAS would have found, had the
    release come during the bind): nothing in the ledger serves the pod (the agent has no
    allocation to hand it), and the next sweep withdraws its grant, as the bind would have;
    nothing is left waiting for a mark."""
    setup = await lapsing_bind(make_service, buckets, cluster)
    uid = setup.a["metadata"]["uid"]

    async def nothing() -> None:
        pass

    assert await filter_and_bind(setup, cluster, nothing) == ""
    releaser = setup.service.scheduler.releaser
    assert uid in releaser.bound_unmarked
    await LedgerWriter(buckets.ledger).release(setup.node, uid)  # another replica's write
    await wait_until(lambda: uid not in (setup.service.index.entries[setup.node].ledger
                                         or NodeLedger(node="x")).allocations)  # fmt: skip
    await setup.service.scheduler.sweep()
    assert_grant_withdrawn(cluster, setup.a)
    assert releaser.bound_unmarked == {}


@pytest.mark.parametrize("taker", TAKERS)
async def test_sweep_does_not_adopt_a_bound_pod_whose_room_was_given_away(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, taker: str
) -> None:
    """A replica bound pod a in the cluster and died before recording it; a's reservation
    lapsed, and its room was given to b. The sweep finds a bound in the cluster but must not
    mark it bound on b's room: a's allocation goes and its grant is withdrawn."""
    setup = await lapsing_bind(make_service, buckets, cluster)
    a = setup.a
    async with http_client(setup.service) as client:
        assert (await filter_call(client, a, [setup.node]))["nodenames"] == [setup.node]
    await cluster.bind_pod("default", a["metadata"]["name"], a["metadata"]["uid"], setup.node)
    setup.skew[0] += setup.service.settings.reservation_ttl_s + 5
    b_uid = await give_room_away(setup, taker, buckets, cluster)
    await setup.service.scheduler.sweep()
    await assert_b_kept_its_room(setup, taker, b_uid, buckets, cluster)
