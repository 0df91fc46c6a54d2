"""Whatever the ledger write (a claim, a bind, the agent's Allocate, one that moves capacity or
depends on the clock), the index kept from each change must read exactly as one built afresh from
the same ledger at the same time."""

from __future__ import annotations

from tessera.scheduler.index import ClusterIndex

from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
)

from .factories import GIB, node

NOW = 1000.0


def grant(registration: NodeRegistration, card: int, gib: int) -> list[list[DeviceGrant]]:
    d = registration.devices[card]
    return [[DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=gib * GIB, cores=10)]]


def allocation(registration: NodeRegistration, uid: str, card: int, gib: int,
               **kw: object) -> Allocation:  # fmt: skip
    return Allocation(pod_uid=uid, namespace="ns", name=uid, node=registration.node,
                      containers=grant(registration, card, gib), **kw)  # fmt: skip


def view(index: ClusterIndex, name: str) -> tuple:
    """Everything the decision reads about a node."""
    entry = index.entries[name]
    slot = entry.slot
    cards = [(c.uuid, c.used_mem, c.used_cores, c.used_slots) for c in entry.cards]
    rows = tuple(getattr(index, a)[slot].tolist() for a in ClusterIndex._ARRAYS)
    return cards, entry.score, entry.reserved_until, rows, dict(index.pod_nodes)


def fresh(registration: NodeRegistration, ledger: NodeLedger, now: float) -> tuple:
    index = ClusterIndex()
    index.set_registration(registration.node, registration, now)
    index.set_ledger(registration.node, ledger, 1, now)
    return view(index, registration.node)


def test_claim_bind_allocate_match_a_fresh_index() -> None:
    registration = node("n-usage", gpus=2)
    index = ClusterIndex()
    index.set_registration(registration.node, registration, NOW)
    other = allocation(registration, "other", 1, 30, state=AllocationState.ALLOCATED)
    reserved = allocation(registration, "p", 0, 10, state=AllocationState.RESERVED,
                          expires_at=NOW + 60)  # fmt: skip
    ledger = NodeLedger(node=registration.node, allocations={"other": other, "p": reserved})
    index.set_ledger(registration.node, ledger, 1, NOW)
    claim = InFlightClaim(pod_uid="p", namespace="ns", name="p", taken_at=NOW,
                          expires_at=NOW + 30, holder="me")  # fmt: skip
    steps = [
        ledger.model_copy(update={"claims": {"p": claim}, "allocations": {
            **ledger.allocations, "p": reserved.model_copy(update={"expires_at": NOW + 90})}}),
        None,  # bound
        None,  # allocated, claim released
    ]  # fmt: skip
    bound = steps[0].allocations["p"].model_copy(
        update={"state": AllocationState.BOUND, "expires_at": None}
    )
    steps[1] = steps[0].model_copy(update={"allocations": {**steps[0].allocations, "p": bound}})
    # The agent's write comes back decoded: equal grants in new objects.
    allocated = Allocation.model_validate(
        bound.model_dump() | {"state": AllocationState.ALLOCATED}
    )
    steps[2] = steps[1].model_copy(
        update={"claims": {}, "allocations": {**steps[1].allocations, "p": allocated}}
    )
    for revision, step in enumerate(steps, start=2):
        index.set_ledger(registration.node, step, revision, NOW + revision)
        assert view(index, registration.node) == fresh(registration, step, NOW + revision)
    busy = index.busy[index.entries[registration.node].slot]
    assert not busy  # the claim is gone and nothing is reserved: the node is not busy


def test_writes_that_move_capacity_or_depend_on_time_read_as_fresh() -> None:
    registration = node("n-usage2", gpus=2)
    index = ClusterIndex()
    index.set_registration(registration.node, registration, NOW)
    reserved = allocation(registration, "p", 0, 10, state=AllocationState.RESERVED,
                          expires_at=NOW + 5)  # fmt: skip
    ledger = NodeLedger(node=registration.node, allocations={"p": reserved})
    index.set_ledger(registration.node, ledger, 1, NOW)
    # Another pod: capacity moves.
    more = ledger.model_copy(update={"allocations": {
        **ledger.allocations, "q": allocation(registration, "q", 1, 20)}})  # fmt: skip
    index.set_ledger(registration.node, more, 2, NOW)
    assert view(index, registration.node) == fresh(registration, more, NOW)
    # The same grants on another card: capacity moves.
    moved = ledger.model_copy(update={"allocations": {
        "p": reserved.model_copy(update={"containers": grant(registration, 1, 10)})}})
    index.set_ledger(registration.node, moved, 3, NOW)
    assert view(index, registration.node) == fresh(registration, moved, NOW)
    # A reservation past its expiry no longer holds its card: rebuilt, and read as free.
    later = NOW + 10
    touched = ledger.model_copy(update={"claims": {}})
    index.set_ledger(registration.node, touched, 4, later)
    assert view(index, registration.node) == fresh(registration, touched, later)
    assert index.entries[registration.node].cards[0].used_mem == 0
    # A victim of preemption: its charge depends on the clock.
    victim = allocation(registration, "v", 1, 10, state=AllocationState.ALLOCATED,
                        preempted_by="nominee", preempted_until=later + 30)  # fmt: skip
    with_victim = NodeLedger(node=registration.node, allocations={"v": victim})
    index.set_ledger(registration.node, with_victim, 5, later)
    assert view(index, registration.node) == fresh(registration, with_victim, later)
    after = later + 31  # the victim's mark lapsed: it holds its card again
    index.set_ledger(registration.node, with_victim.model_copy(), 6, after)
    assert view(index, registration.node) == fresh(registration, with_victim, after)
